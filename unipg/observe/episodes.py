"""``log.episodes``: a run's trained episodes, appended to ``run_dir/episodes.jsonl``.

The records are those of ``unipg.sample.episode_records`` (chat messages, rewards, the exact tokens, behaviour
log-probs and versions), so the file is at once a readable transcript and offline data for a later run
(``data.offline.path``). A resumed run appends after the records of its interrupted updates, which can therefore
appear twice.
"""

from __future__ import annotations

import json
from pathlib import Path

from unipg.sample.episode_records import episode_record

EPISODES_FILE = "episodes.jsonl"


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
