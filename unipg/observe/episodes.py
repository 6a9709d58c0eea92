"""``log.episodes``: a run's trained episodes, appended to ``run_dir/episodes.jsonl``.

The records are those of ``unipg.sample.episode_records`` (chat messages, rewards, the exact tokens, behaviour
log-probs and versions), so the file is at once a readable transcript and offline data for a later run
(``data.offline.path``). A resumed run moves the records of the updates after its checkpoint (and a line cut short by
a kill) to ``episodes.superseded.jsonl`` before it trains them again, so episodes.jsonl holds each update once and
nothing written is lost.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from unipg.sample.episode_records import episode_record

EPISODES_FILE = "episodes.jsonl"
SUPERSEDED_FILE = "episodes.superseded.jsonl"


class EpisodeLog:
    """Appends the episodes each learner update trains on to ``run_dir/episodes.jsonl``."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / EPISODES_FILE
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, trajectories: list, *, update: int) -> None:
        for trajectory in trajectories:
            self._file.write(json.dumps(episode_record(trajectory, update=update)) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def supersede_episodes_after(run_dir: Path, update: int) -> int:
    """Move the records of updates after ``update`` (and any line that is not a whole record: one cut short by a
    kill) from ``run_dir``'s episodes.jsonl to the end of episodes.superseded.jsonl; returns how many moved. The
    superseded file is written (and flushed to disk) before episodes.jsonl is replaced, so a kill in between
    leaves a record in both files, never in neither."""
    path = Path(run_dir) / EPISODES_FILE
    if not path.is_file():
        return 0
    kept, moved = [], []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        (kept if line.endswith("\n") and _update_of(line) <= update else moved).append(line)
    if not moved:
        return 0
    with (Path(run_dir) / SUPERSEDED_FILE).open("a", encoding="utf-8") as superseded:
        superseded.writelines(line if line.endswith("\n") else line + "\n" for line in moved)
        superseded.flush()
        os.fsync(superseded.fileno())
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    tmp.replace(path)
    return len(moved)


def _update_of(line: str) -> float:
    """The ``update`` of a record line; infinity for a line that is not a record (moved aside, not dropped)."""
    try:
        return json.loads(line)["update"]
    except (ValueError, KeyError, TypeError):
        return math.inf
