"""The files of one checkpoint: safetensors for tensors, JSON for everything else, never pickle.

Layout of a checkpoint folder::

    step-00000120/
      policy.safetensors      one file per tensor group ("policy", "optimizer", "critic", "value_head", ...)
      optimizer.safetensors
      state.json              everything else: step, policy version, KL coefficient, data position, RNG states
      manifest.json           format version, step, metrics, every file's size and sha256, tied-tensor aliases

A learner sharded over several ranks (``train.learner_processes`` > 1) writes a sharded checkpoint instead: the
ranks write the trainable weights, the optimizer's state and the float32 masters with
``torch.distributed.checkpoint`` (DCP), each rank its own shards, and the tensor groups are left out::

    step-00000120/
      __0_0.distcp            rank 0's shards of every tensor (torch.save records, read with weights_only)
      __1_0.distcp            rank 1's
      .metadata               the index: each tensor's size and dtype, and which file holds which of its chunks
      state.json
      manifest.json           format version 2, "sharded": true, the size and sha256 of every file above

Its tensors are named ``model.<weight>``, ``optimizer.state.<weight>.<key>`` and ``masters.<weight>``; it loads
with any number of ranks, one process included (``unipg.learn.distributed.load_sharded``), and
``unipg.checkpoint.shards`` reads it whole in one process.

Every file is fsynced as it is written, the manifest last. Bit rot or a truncated copy is caught by the sha256
of every file in the manifest (``verify_checkpoint``). Every way a checkpoint can be unreadable (a missing or
truncated file, a garbled manifest, a path that is not a checkpoint folder) raises ``ValueError`` saying what
is wrong.

Tensors that share memory (tied embeddings) are stored once and recorded as aliases in the manifest, so a
load gives back one tensor under both names. What goes into a checkpoint besides model weights (an optimizer's
state, the random generators) is turned into tensor groups and JSON by ``unipg.learn.state``. Where the
folders live, and how they are published atomically and rotated, is ``unipg.checkpoint.store``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from unipg.learn.distributed import SHARD_INDEX, read_shard_index

FORMAT_VERSION = 1  # a checkpoint of tensor groups in safetensors files
SHARDED_FORMAT_VERSION = 2  # a sharded checkpoint (DCP files); the newest version this code reads
MANIFEST_FILE = "manifest.json"
STATE_FILE = "state.json"


@dataclass
class Checkpoint:
    """A loaded, checksum-verified checkpoint."""

    path: Path
    step: int
    tensors: dict[str, dict[str, torch.Tensor]]  # group ("policy", "optimizer", ...) → name → tensor
    state: dict  # the JSON state given to save()
    metrics: dict[str, float]
    sharded: bool = False  # the tensors are the DCP shards in ``path`` (``tensors`` is empty), loaded by the learner


# --- durable files -----------------------------------------------------------------------------------


def fsync_path(path: Path) -> None:
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


def json_bytes(value, what: str) -> bytes:
    try:
        return json.dumps(value, indent=1, sort_keys=True).encode()
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"the checkpoint {what} must be JSON-serializable ({error}); put tensors in a tensor "
            "group and encode RNG states with rng_state()/generator_state()"
        ) from None


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
            raise TypeError(
                f"tensor group entry {name!r} is a {type(tensor).__name__}, not a torch.Tensor; "
                "put non-tensor values in the JSON state instead"
            )
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


def write_checkpoint_files(
    directory: Path,
    step: int,
    tensors: dict[str, dict[str, torch.Tensor]],
    state_bytes: bytes,
    metrics: dict[str, float],
    extra_files: dict[str, bytes] | None = None,
    *,
    sharded: bool = False,
) -> None:
    """Every file of a checkpoint into ``directory``, each fsynced; the manifest last. ``extra_files`` (name →
    contents, e.g. an adapter's ``adapter_config.json``) are written and checksummed beside the tensors; with
    ``sharded``, the DCP files the ranks wrote into ``directory`` are checksummed too."""
    for name, data in (extra_files or {}).items():
        _write_durably(directory / name, data)
    groups = {}
    for group, group_tensors in tensors.items():
        stored, aliases = _storable(group_tensors)
        file = directory / f"{group}.safetensors"
        save_file(stored, file)
        fsync_path(file)
        groups[group] = {"file": file.name, "aliases": aliases}
        del stored  # a group's CPU copies need not outlive its file
    _write_durably(directory / STATE_FILE, state_bytes)
    files = {path.name: {"bytes": path.stat().st_size, "sha256": _sha256(path)} for path in sorted(directory.iterdir())}
    manifest = {
        "format_version": SHARDED_FORMAT_VERSION if sharded else FORMAT_VERSION,
        "step": step,
        "metrics": metrics,
        "files": files,
        "tensor_groups": groups,
    }
    if sharded:
        manifest["sharded"] = True
    _write_durably(directory / MANIFEST_FILE, json_bytes(manifest, "manifest"))


# --- verifying and loading ---------------------------------------------------------------------------


def _corrupted(path: Path, problem: str) -> ValueError:
    return ValueError(
        f"checkpoint {path} is corrupted or incomplete: {problem}; load an older checkpoint "
        "(CheckpointStore.latest() skips corrupted ones)"
    )


def read_manifest(path: Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        problem = "is a file, not a checkpoint folder" if path.exists() else "does not exist"
        raise ValueError(
            f"checkpoint {path} {problem}; pass a step-<number> folder written by "
            "CheckpointStore.save (CheckpointStore(root).list() lists them)"
        )
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
    if manifest["format_version"] > SHARDED_FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {path} has format version {manifest['format_version']}; this code reads "
            f"versions up to {SHARDED_FORMAT_VERSION}: load it with a newer unipg"
        )
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
    if manifest.get("sharded") and SHARD_INDEX not in files:
        return f"marks the checkpoint sharded and has no checksum for its index {SHARD_INDEX}"
    return None


def verify_checkpoint(path: str | Path) -> dict:
    """The checkpoint's manifest, after checking every file's size and sha256; ``ValueError`` if any differs."""
    path = Path(path)
    manifest = read_manifest(path)
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
                raise _corrupted(
                    path,
                    f"alias {alias!r} of tensor group {group!r} names {stored_name!r}, which "
                    f"{entry['file']} does not hold",
                )
    try:
        json.loads((path / STATE_FILE).read_bytes())
    except (ValueError, RecursionError) as error:
        raise _corrupted(path, f"{STATE_FILE} is not valid JSON ({error})") from None
    if manifest.get("sharded"):
        _check_shard_index(path, manifest)


def _check_shard_index(path: Path, manifest: dict) -> None:
    """Whether a sharded checkpoint's index parses, and names only files its manifest checksums."""
    try:
        index = read_shard_index(path)
        named = {stored.relative_path for stored in index.storage_data.values()}
    except Exception as error:  # noqa: BLE001 — whatever a damaged pickle raises, the checkpoint is unreadable
        raise _corrupted(
            path, f"{SHARD_INDEX} is not a readable shard index ({type(error).__name__}: {error})"
        ) from None
    unlisted = sorted(named - set(manifest["files"]))
    if unlisted:
        raise _corrupted(path, f"{SHARD_INDEX} names {unlisted[0]}, which the manifest does not list")


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
    return Checkpoint(
        path=path,
        step=manifest["step"],
        tensors=tensors,
        state=state,
        metrics=manifest["metrics"],
        sharded=bool(manifest.get("sharded")),
    )


def tensor_mismatch(saved: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> str | None:
    """Why ``saved`` tensors do not load into a module whose ``state_dict()`` is ``expected`` — shapes that
    differ, names missing on either side, each counted with a first example — or None when they fit."""
    reshaped = [name for name in expected if name in saved and saved[name].shape != expected[name].shape]
    missing = [name for name in expected if name not in saved]
    unexpected = [name for name in saved if name not in expected]
    problems = []
    if reshaped:
        name = reshaped[0]
        problems.append(
            f"{len(reshaped)} tensor(s) differ in shape, e.g. {name} is {tuple(saved[name].shape)} in "
            f"the checkpoint and {tuple(expected[name].shape)} in the model"
        )
    if missing:
        problems.append(f"{len(missing)} tensor(s) of the model are not in the checkpoint, e.g. {missing[0]}")
    if unexpected:
        problems.append(f"{len(unexpected)} tensor(s) of the checkpoint are not in the model, e.g. {unexpected[0]}")
    return "; ".join(problems) or None
