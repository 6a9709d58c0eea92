"""Crash-safe training checkpoints: numbered checkpoint folders under one root, saved atomically and rotated.

Layout on disk (each ``step-*`` folder holds the files of ``unipg.checkpoint.files``)::

    root/
      step-00000120/
      step-00000160/
      .tmp-step-00000200-4711/  a save in progress (or interrupted): ignored by loaders, removed by the next save
      damaged-step-00000180/    a checkpoint that failed verification, set aside (``set_aside``), never deleted

Atomicity. A save writes the whole checkpoint into ``.tmp-step-<step>-<pid>``, fsyncs every file and that
folder, then ``os.rename``s it to ``step-<step>`` and fsyncs ``root`` so the rename itself is durable. A
rename within one filesystem is atomic, so at any instant a ``step-*`` folder is either absent or complete;
a crash (even SIGKILL or power loss) before the rename leaves only a ``.tmp-*`` folder, and the checkpoints
saved earlier are untouched. Rotation renames a doomed checkpoint to ``.tmp-*`` before deleting it, so a
half-deleted checkpoint never looks like a real one. ``CheckpointStore.latest`` skips a checkpoint that fails
its sha256 checksums, with a warning, and a save whose step folder exists but fails them renames that folder
to ``damaged-step-*`` instead of replacing it.

One process writes to a given ``root`` at a time; the next save removes every ``.tmp-*`` folder it finds. The
ranks of a sharded learner write their shards into the save's ``.tmp-*`` folder (``save(shards=...)``); the
process that saves checksums their files, writes the manifest and renames the folder once all have returned.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch

from unipg.checkpoint.files import (  # noqa: F401  (Checkpoint, load_checkpoint, tensor_mismatch re-exported)
    MANIFEST_FILE,
    Checkpoint,
    fsync_path,
    json_bytes,
    load_checkpoint,
    read_manifest,
    tensor_mismatch,
    verify_checkpoint,
    write_checkpoint_files,
)

TMP_PREFIX = ".tmp-"
DAMAGED_PREFIX = "damaged-"  # a checkpoint that failed verification, set aside rather than deleted
_STEP_DIR = re.compile(r"step-(\d+)")
_GROUP_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


class CheckpointStore:
    """Numbered checkpoints under ``root``: atomic saves, rotation, and the newest or best valid one.

    After each save it keeps the ``keep_last`` newest checkpoints, the ``keep_best`` best by the metric
    ``best_metric`` ("max": higher is better, "min": lower) and the one just written; it deletes the rest.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        keep_last: int = 3,
        keep_best: int = 1,
        best_metric: str | None = None,
        mode: Literal["max", "min"] = "max",
    ):
        if keep_last < 0 or keep_best < 0:
            raise ValueError(f"keep_last ({keep_last}) and keep_best ({keep_best}) must be ≥ 0")
        if mode not in ("max", "min"):
            raise ValueError(f"mode ({mode!r}) must be 'max' (higher {best_metric} is better) or 'min'")
        self.root = Path(root)
        self.keep_last, self.keep_best, self.best_metric, self.mode = keep_last, keep_best, best_metric, mode

    def save(
        self,
        step: int,
        tensors: dict[str, dict[str, torch.Tensor]],
        state: dict,
        *,
        metrics: dict[str, float] | None = None,
        extra_files: dict[str, bytes] | None = None,
        shards: Callable[[Path], None] | None = None,
    ) -> Path:
        """Write ``root/step-{step:08d}`` atomically, then rotate; returns its path.

        ``tensors`` maps a group name to a flat ``name → tensor`` dict (one safetensors file per group);
        ``state`` must be JSON-serializable; ``extra_files`` maps plain file names to their bytes. ``shards``, if
        given, writes a sharded learner's files into the folder being saved and returns once they are written
        (``unipg.learn.sharded.ShardedLMLearner.save_shards``); the checkpoint is then sharded (format version 2).
        Saving a step that exists replaces it.
        """
        if step < 0:
            raise ValueError(f"step ({step}) must be ≥ 0")
        for group in tensors:
            if not _GROUP_NAME.fullmatch(group):
                raise ValueError(f"tensor group name {group!r} must be a plain file name: letters, digits, _ . -")
        for name in extra_files or {}:
            if (
                not _GROUP_NAME.fullmatch(name)
                or name.endswith(".safetensors")
                or name in (MANIFEST_FILE, "state.json")
            ):
                raise ValueError(f"extra file name {name!r} must be a plain file name that is not a checkpoint's own")
        # Check everything that can be checked before touching the disk.
        state_bytes = json_bytes(state, "state")
        metrics = {str(name): float(value) for name, value in (metrics or {}).items()}
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(
                f"cannot save checkpoints in {self.root}: it is a file, not a folder; move the file "
                "away or choose another checkpoint folder"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_stray_tmp()
        final = self.root / f"step-{step:08d}"
        tmp = self.root / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
        tmp.mkdir()
        try:
            if shards is not None:
                shards(tmp)
            write_checkpoint_files(tmp, step, tensors, state_bytes, metrics, extra_files, sharded=shards is not None)
            fsync_path(tmp)
            self._publish(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._rotate(just_written=final)
        return final

    def list(self) -> list[Path]:
        """Complete checkpoints (manifest present), oldest first. Checksums are not verified here."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            match = _STEP_DIR.fullmatch(entry.name)
            if match and (entry / MANIFEST_FILE).is_file():
                found.append((int(match[1]), entry))
        return [path for _, path in sorted(found)]

    def latest(self) -> Path | None:
        """The newest checkpoint whose checksums verify; corrupted newer ones are skipped with a warning."""
        return self._first_valid(reversed(self.list()))

    def best(self) -> Path | None:
        """The valid checkpoint with the best ``best_metric``; ties go to the newer one."""
        if self.best_metric is None:
            raise ValueError("best() needs a metric: create the store with best_metric='...'")
        return self._first_valid(self._ranked(self.list()))

    def remove(self, step: int) -> None:
        """Delete the checkpoint of ``step`` if there is one (renamed to ``.tmp-*`` first, as rotation does)."""
        path = self.root / f"step-{step:08d}"
        if path.is_dir():
            self._remove(path)

    def set_aside(self, path: Path) -> Path:
        """Rename a damaged checkpoint to ``damaged-step-<step>[-<n>]`` so that no save replaces it and no
        rotation deletes it, while it stays on disk for inspection or repair; returns the new path."""
        target = self.root / f"{DAMAGED_PREFIX}{path.name}"
        copies = 1
        while target.exists():
            copies += 1
            target = self.root / f"{DAMAGED_PREFIX}{path.name}-{copies}"
        os.rename(path, target)
        fsync_path(self.root)
        return target

    def _first_valid(self, paths) -> Path | None:
        for path in paths:
            try:
                verify_checkpoint(path)
                return path
            except ValueError as error:
                warnings.warn(f"skipping checkpoint {path.name}: {error}", RuntimeWarning, stacklevel=3)
        return None

    @staticmethod
    def _intact(path: Path) -> bool:
        try:
            verify_checkpoint(path)
        except ValueError:
            return False
        return True

    def _ranked(self, paths: list[Path]) -> list[Path]:
        """Checkpoints that report a finite ``best_metric``, best first."""
        sign = 1.0 if self.mode == "max" else -1.0
        scored = []
        for age, path in enumerate(paths):  # paths come oldest first, so a larger index is newer
            try:
                value = float(read_manifest(path)["metrics"][self.best_metric])
            except (ValueError, KeyError, TypeError):
                continue
            if math.isfinite(value):
                scored.append((sign * value, age, path))
        return [path for *_, path in sorted(scored, key=lambda item: item[:2], reverse=True)]

    def _publish(self, tmp: Path, final: Path) -> None:
        displaced = None
        if final.exists() and not self._intact(final):
            moved = self.set_aside(final)
            warnings.warn(
                f"checkpoint {final.name} failed verification; kept as {moved.name} instead of being "
                "replaced by the new save (delete it once it is no longer needed)",
                RuntimeWarning,
                stacklevel=3,
            )
        elif final.exists():
            # A resumed run re-reaching a saved step: move the old one aside under a .tmp- name (rename
            # cannot replace a non-empty folder); a crash in between loses only this step, no older one.
            displaced = self.root / f"{TMP_PREFIX}replaced-{final.name}-{os.getpid()}"
            os.rename(final, displaced)
        os.rename(tmp, final)
        fsync_path(self.root)  # make the rename itself durable
        if displaced is not None:
            shutil.rmtree(displaced, ignore_errors=True)

    def _rotate(self, just_written: Path) -> None:
        checkpoints = self.list()
        keep = {just_written}
        if self.keep_last:
            keep.update(checkpoints[-self.keep_last :])
        if self.best_metric is not None and self.keep_best:
            keep.update(self._ranked(checkpoints)[: self.keep_best])
        for path in checkpoints:
            if path not in keep:
                self._remove(path)

    def _remove(self, path: Path) -> None:
        # Renamed first so that a crash mid-delete leaves a .tmp- folder, never a partial step- folder.
        doomed = self.root / f"{TMP_PREFIX}removed-{path.name}-{os.getpid()}"
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    def _remove_stray_tmp(self) -> None:
        for entry in self.root.glob(f"{TMP_PREFIX}*"):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
