"""Crash-safe training checkpoints: safetensors for tensors, JSON for everything else, never pickle.

Layout on disk::

    root/
      step-00000120/
        policy.safetensors      one file per tensor group ("policy", "optimizer", "critic", "value_head", ...)
        optimizer.safetensors
        state.json              everything else: step, policy version, KL coefficient, data position, RNG states
        manifest.json           format version, step, metrics, every file's size and sha256, tied-tensor aliases
      step-00000160/
      .tmp-step-00000200-4711/  a save in progress (or interrupted): ignored by loaders, removed by the next save
      damaged-step-00000180/    a checkpoint that failed verification, set aside (``set_aside``), never deleted

Atomicity. A save writes the whole checkpoint into ``.tmp-step-<step>-<pid>``, fsyncs every file and that
folder, then ``os.rename``s it to ``step-<step>`` and fsyncs ``root`` so the rename itself is durable. A
rename within one filesystem is atomic, so at any instant a ``step-*`` folder is either absent or complete;
a crash (even SIGKILL or power loss) before the rename leaves only a ``.tmp-*`` folder, and the checkpoints
saved earlier are untouched. Rotation renames a doomed checkpoint to ``.tmp-*`` before deleting it, so a
half-deleted checkpoint never looks like a real one. Bit rot or a truncated copy is caught by the sha256 of
every file in the manifest: ``CheckpointStore.latest`` skips a checkpoint that fails it, with a warning, and a
save whose step folder exists but fails it renames that folder to ``damaged-step-*`` instead of replacing it.
Every way a checkpoint can be unreadable (a missing or truncated file, a garbled manifest, a path that is not a
checkpoint folder) raises ``ValueError`` saying what is wrong.

One process writes to a given ``root`` at a time (on several ranks, save from one of them); the next save
removes every ``.tmp-*`` folder it finds.

Tensors that share memory (tied embeddings) are stored once and recorded as aliases in the manifest, so a
load gives back one tensor under both names. What goes into a checkpoint besides model weights (an optimizer's
state, the random generators) is turned into tensor groups and JSON by ``unipg.learn.state``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
STATE_FILE = "state.json"
TMP_PREFIX = ".tmp-"
DAMAGED_PREFIX = "damaged-"  # a checkpoint that failed verification, set aside rather than deleted
_STEP_DIR = re.compile(r"step-(\d+)")
_GROUP_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


@dataclass
class Checkpoint:
    """A loaded, checksum-verified checkpoint."""

    path: Path
    step: int
    tensors: dict[str, dict[str, torch.Tensor]]  # group ("policy", "optimizer", ...) → name → tensor
    state: dict  # the JSON state given to save()
    metrics: dict[str, float]


# --- durable files -----------------------------------------------------------------------------------


def _fsync_path(path: Path) -> None:
    """Flush a file's or a folder's data and metadata to the disk (a folder's fsync makes its entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 23):
            digest.update(chunk)
    return digest.hexdigest()


def _json_bytes(value, what: str) -> bytes:
    try:
        return json.dumps(value, indent=1, sort_keys=True).encode()
    except (TypeError, ValueError) as error:
        raise TypeError(f"the checkpoint {what} must be JSON-serializable ({error}); put tensors in a tensor "
                        "group and encode RNG states with rng_state()/generator_state()") from None


# --- tensor groups -----------------------------------------------------------------------------------


def _storable(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors safetensors accepts (CPU, contiguous, no shared memory) and the aliases left out (name → stored name).

    Two names for one view of memory (tied weights) are stored once and aliased, so the tie survives a load.
    Different views of one storage (a slice and its whole) cannot be aliased; each is copied, so the values
    survive but the sharing does not.
    """
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first_name_of_view: dict[tuple, str] = {}
    users_of_storage: dict[tuple, int] = {}
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor group entry {name!r} is a {type(tensor).__name__}, not a torch.Tensor; "
                            "put non-tensor values in the JSON state instead")
        tensor = tensor.detach()
        if tensor.numel() == 0:  # empty tensors have no memory to share
            stored[name] = tensor.cpu()
            continue
        storage = (str(tensor.device), tensor.untyped_storage().data_ptr())
        view = (*storage, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if view in first_name_of_view:
            aliases[name] = first_name_of_view[view]
            continue
        first_name_of_view[view] = name
        users_of_storage[storage] = users_of_storage.get(storage, 0) + 1
        stored[name] = tensor
    for name, tensor in stored.items():
        if tensor.device.type != "cpu":
            stored[name] = tensor.cpu().contiguous()  # the copy to the CPU owns its memory
        elif tensor.numel() and users_of_storage[(str(tensor.device), tensor.untyped_storage().data_ptr())] > 1:
            stored[name] = tensor.clone(memory_format=torch.contiguous_format)
        else:
            stored[name] = tensor.contiguous()
    return stored, aliases


def _write_checkpoint_files(directory: Path, step: int, tensors: dict[str, dict[str, torch.Tensor]],
                            state_bytes: bytes, metrics: dict[str, float]) -> None:
    """Every file of a checkpoint into ``directory``, each fsynced; the manifest last."""
    groups = {}
    for group, group_tensors in tensors.items():
        stored, aliases = _storable(group_tensors)
        file = directory / f"{group}.safetensors"
        save_file(stored, file)
        _fsync_path(file)
        groups[group] = {"file": file.name, "aliases": aliases}
        del stored  # a group's CPU copies need not outlive its file
    _write_durably(directory / STATE_FILE, state_bytes)
    files = {path.name: {"bytes": path.stat().st_size, "sha256": _sha256(path)}
             for path in sorted(directory.iterdir())}
    manifest = {"format_version": FORMAT_VERSION, "step": step, "metrics": metrics, "files": files,
                "tensor_groups": groups}
    _write_durably(directory / MANIFEST_FILE, _json_bytes(manifest, "manifest"))


# --- verifying and loading ---------------------------------------------------------------------------


def _corrupted(path: Path, problem: str) -> ValueError:
    return ValueError(f"checkpoint {path} is corrupted or incomplete: {problem}; load an older checkpoint "
                      "(CheckpointStore.latest() skips corrupted ones)")


def _read_manifest(path: Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        problem = "is a file, not a checkpoint folder" if path.exists() else "does not exist"
        raise ValueError(f"checkpoint {path} {problem}; pass a step-<number> folder written by "
                         "CheckpointStore.save (CheckpointStore(root).list() lists them)")
    manifest_file = path / MANIFEST_FILE
    if not manifest_file.is_file():
        raise _corrupted(path, f"{manifest_file.name} is missing")
    try:
        manifest = json.loads(manifest_file.read_bytes())
    except (ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise _corrupted(path, f"{manifest_file.name} is not valid JSON ({error})") from None
    except OSError as error:
        raise _corrupted(path, f"{manifest_file.name} cannot be read ({error})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("format_version"), int):
        raise _corrupted(path, f"{manifest_file.name} is not an object with an integer format_version")
    if manifest["format_version"] > FORMAT_VERSION:
        raise ValueError(f"checkpoint {path} has format version {manifest['format_version']}; this code reads "
                         f"versions up to {FORMAT_VERSION}: load it with a newer unipg")
    problem = _manifest_problem(manifest)
    if problem:
        raise _corrupted(path, f"{manifest_file.name} {problem}")
    return manifest


def _manifest_problem(manifest: dict) -> str | None:
    """What is missing or mistyped in a manifest, or None; every file a load reads must have a checksum."""
    if not isinstance(manifest.get("step"), int) or not isinstance(manifest.get("metrics"), dict):
        return "lacks an integer 'step' or a 'metrics' object"
    files, groups = manifest.get("files"), manifest.get("tensor_groups")
    if not isinstance(files, dict) or not isinstance(groups, dict):
        return "lacks the 'files' or 'tensor_groups' object"
    for name, entry in files.items():
        entry = entry if isinstance(entry, dict) else {}
        if not isinstance(entry.get("bytes"), int) or not isinstance(entry.get("sha256"), str):
            return f"has no size and sha256 for {name!r}"
    for group, entry in groups.items():
        if not (isinstance(entry, dict) and entry.get("file") in files and isinstance(entry.get("aliases"), dict)):
            return f"lists tensor group {group!r} without a checksummed file or its aliases"
    if STATE_FILE not in files:
        return f"has no checksum for {STATE_FILE}"
    return None


def verify_checkpoint(path: str | Path) -> dict:
    """The checkpoint's manifest, after checking every file's size and sha256; ``ValueError`` if any differs."""
    path = Path(path)
    manifest = _read_manifest(path)
    for name, entry in manifest["files"].items():
        file = path / name
        if name != Path(name).name or not file.is_file():
            raise _corrupted(path, f"file {name!r} listed in the manifest is missing")
        try:
            if file.stat().st_size != entry["bytes"] or _sha256(file) != entry["sha256"]:
                raise _corrupted(path, f"{name} does not match the size and sha256 checksum in its manifest")
        except OSError as error:
            raise _corrupted(path, f"{name} cannot be read ({error})") from None
    _check_contents(path, manifest)
    return manifest


def _check_contents(path: Path, manifest: dict) -> None:
    """Whether the files whose checksums matched also parse (they could have been checksummed after a bad
    edit): each tensor file's header, with the tensors its aliases name, and state.json. Reads no tensor."""
    for group, entry in manifest["tensor_groups"].items():
        try:
            with safe_open(path / entry["file"], framework="pt") as file:
                names = set(file.keys())
        except (SafetensorError, OSError) as error:
            raise _corrupted(path, f"{entry['file']} is not a readable safetensors file ({error})") from None
        for alias, stored_name in entry["aliases"].items():
            if stored_name not in names:
                raise _corrupted(path, f"alias {alias!r} of tensor group {group!r} names {stored_name!r}, which "
                                       f"{entry['file']} does not hold")
    try:
        json.loads((path / STATE_FILE).read_bytes())
    except (ValueError, RecursionError) as error:
        raise _corrupted(path, f"{STATE_FILE} is not valid JSON ({error})") from None


def load_checkpoint(path: str | Path, *, device: str = "cpu") -> Checkpoint:
    """Load and verify a checkpoint folder; tensors go to ``device``. ``ValueError`` if it is corrupted."""
    path = Path(path)
    manifest = verify_checkpoint(path)
    tensors = {}
    for group, entry in manifest["tensor_groups"].items():
        try:  # verified above; this catches a file changed in the meantime
            loaded = load_file(path / entry["file"], device=device)
        except (SafetensorError, OSError) as error:
            raise _corrupted(path, f"{entry['file']} is not a readable safetensors file ({error})") from None
        for alias, stored_name in entry["aliases"].items():
            loaded[alias] = loaded[stored_name]  # one tensor under both names, as when saved
        tensors[group] = loaded
    state = json.loads((path / STATE_FILE).read_bytes())
    return Checkpoint(path=path, step=manifest["step"], tensors=tensors, state=state, metrics=manifest["metrics"])


def tensor_mismatch(saved: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> str | None:
    """Why ``saved`` tensors do not load into a module whose ``state_dict()`` is ``expected`` — shapes that
    differ, names missing on either side, each counted with a first example — or None when they fit."""
    reshaped = [name for name in expected if name in saved and saved[name].shape != expected[name].shape]
    missing = [name for name in expected if name not in saved]
    unexpected = [name for name in saved if name not in expected]
    problems = []
    if reshaped:
        name = reshaped[0]
        problems.append(f"{len(reshaped)} tensor(s) differ in shape, e.g. {name} is {tuple(saved[name].shape)} in "
                        f"the checkpoint and {tuple(expected[name].shape)} in the model")
    if missing:
        problems.append(f"{len(missing)} tensor(s) of the model are not in the checkpoint, e.g. {missing[0]}")
    if unexpected:
        problems.append(f"{len(unexpected)} tensor(s) of the checkpoint are not in the model, e.g. {unexpected[0]}")
    return "; ".join(problems) or None


# --- the store ---------------------------------------------------------------------------------------


class CheckpointStore:
    """Numbered checkpoints under ``root``: atomic saves, rotation, and the newest or best valid one.

    After each save it keeps the ``keep_last`` newest checkpoints, the ``keep_best`` best by the metric
    ``best_metric`` ("max": higher is better, "min": lower) and the one just written; it deletes the rest.
    """

    def __init__(self, root: str | Path, *, keep_last: int = 3, keep_best: int = 1, best_metric: str | None = None,
                 mode: Literal["max", "min"] = "max"):
        if keep_last < 0 or keep_best < 0:
            raise ValueError(f"keep_last ({keep_last}) and keep_best ({keep_best}) must be ≥ 0")
        if mode not in ("max", "min"):
            raise ValueError(f"mode ({mode!r}) must be 'max' (higher {best_metric} is better) or 'min'")
        self.root = Path(root)
        self.keep_last, self.keep_best, self.best_metric, self.mode = keep_last, keep_best, best_metric, mode

    def save(self, step: int, tensors: dict[str, dict[str, torch.Tensor]], state: dict, *,
             metrics: dict[str, float] | None = None) -> Path:
        """Write ``root/step-{step:08d}`` atomically, then rotate; returns its path.

        ``tensors`` maps a group name to a flat ``name → tensor`` dict (one safetensors file per group);
        ``state`` must be JSON-serializable. Saving a step that exists replaces it.
        """
        if step < 0:
            raise ValueError(f"step ({step}) must be ≥ 0")
        for group in tensors:
            if not _GROUP_NAME.fullmatch(group):
                raise ValueError(f"tensor group name {group!r} must be a plain file name: letters, digits, _ . -")
        # Check everything that can be checked before touching the disk.
        state_bytes = _json_bytes(state, "state")
        metrics = {str(name): float(value) for name, value in (metrics or {}).items()}
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"cannot save checkpoints in {self.root}: it is a file, not a folder; move the file "
                             "away or choose another checkpoint folder")
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_stray_tmp()
        final = self.root / f"step-{step:08d}"
        tmp = self.root / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
        tmp.mkdir()
        try:
            _write_checkpoint_files(tmp, step, tensors, state_bytes, metrics)
            _fsync_path(tmp)
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
        _fsync_path(self.root)
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
                value = float(_read_manifest(path)["metrics"][self.best_metric])
            except (ValueError, KeyError, TypeError):
                continue
            if math.isfinite(value):
                scored.append((sign * value, age, path))
        return [path for *_, path in sorted(scored, key=lambda item: item[:2], reverse=True)]

    def _publish(self, tmp: Path, final: Path) -> None:
        displaced = None
        if final.exists() and not self._intact(final):
            moved = self.set_aside(final)
            warnings.warn(f"checkpoint {final.name} failed verification; kept as {moved.name} instead of being "
                          "replaced by the new save (delete it once it is no longer needed)", RuntimeWarning,
                          stacklevel=3)
        elif final.exists():
            # A resumed run re-reaching a saved step: move the old one aside under a .tmp- name (rename
            # cannot replace a non-empty folder); a crash in between loses only this step, no older one.
            displaced = self.root / f"{TMP_PREFIX}replaced-{final.name}-{os.getpid()}"
            os.rename(final, displaced)
        os.rename(tmp, final)
        _fsync_path(self.root)  # make the rename itself durable
        if displaced is not None:
            shutil.rmtree(displaced, ignore_errors=True)

    def _rotate(self, just_written: Path) -> None:
        checkpoints = self.list()
        keep = {just_written}
        if self.keep_last:
            keep.update(checkpoints[-self.keep_last:])
        if self.best_metric is not None and self.keep_best:
            keep.update(self._ranked(checkpoints)[:self.keep_best])
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
