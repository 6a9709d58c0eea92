"""``train.learner_processes`` > 1: the lm learner sharded with FSDP2 over ``N`` ranks, behind the ``LMLearner``
interface, so that the driver, the rollout and the checkpoints do not change.

The driver's process keeps its unsharded policy, on which rollout and evaluation run as with one process.
The learner runs in ``N`` ranks (``LearnerRank``) that start from that policy's weights, shard it
(``unipg.learn.distributed.shard_model``) and each run an ``LMLearner`` on every batch, taking a share of the
micro-batches. The driver's ``ShardedLMLearner`` sends every call to every rank and takes rank 0's answer.
After every update the ranks gather the full weights once and rank 0 sends back the trained ones (the LoRA
adapter alone when the base is frozen; never the frozen reference), which the handle loads into the driver's
policy: what the inference side samples from. A checkpoint is written by the ranks, each its own shards of
the trainable weights, the optimizer's state and the float32 masters (``save_shards``, with
``torch.distributed.checkpoint``), so that no rank gathers them; it loads back with any number of ranks, one
process included (``load_shards``, ``unipg.learn.distributed.load_sharded``). A one-process checkpoint (safetensors)
restores into the ranks too (``restore``): every rank receives its tensors whole and keeps its shard.

Where the ranks run is a launcher's business, behind one small interface (``Ranks``: ``call``, ``close``):
``LocalRanks`` spawns local processes (``backend: inprocess``); ``unipg.runtime.backends.ray_learner.RayRanks``
places Ray actors in a placement group (``backend: ray``). Both run ``LearnerRank``.

Local ranks are started with the ``spawn`` method: a script that calls ``unipg.train`` with learner processes
must do so under ``if __name__ == "__main__":`` (the command line does).

No wait is unbounded (``train.learner_timeout``): a rank waits that long for its peers in the rendezvous and in
each collective, and ``LocalRanks`` waits that long for every rank's answer to a call. Either way the driver raises
``WaitTimeout`` naming the ranks that did not answer, and closing the ranks then ends their processes without
asking them (the ``Ranks`` on Ray wait ``ray.call_timeout``).
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from unipg.config import Config
from unipg.config.devices import resolve_device
from unipg.config.timeouts import WaitTimeout
from unipg.learn.distributed import (
    free_port,
    full_state_dict,
    init_group,
    keep_implementation,
    load_sharded,
    save_sharded,
    shard_model,
)
from unipg.learn.lm import LMBatch, LMLearner
from unipg.learn.state import load_optimizer
from unipg.policy.lm import LMPolicy

# LMBatch fields that ``prepare`` computes, sent back to the driver's copy of the batch.
PREPARED = ("proximal_logprobs", "reference_logprobs", "values", "advantages", "returns")
# The optimizer's entry in a sharded learner's JSON state: its state is in the shards (``save_shards``).
IN_SHARDS = {"in_shards": True}
STUCK_HINT = (
    "a rank may be stuck, or waiting in a collective for a peer that is (a peer that never joins one); raise "
    "train.learner_timeout if a step of this model needs longer"
)


class Ranks(Protocol):
    """The ranks of a sharded learner, wherever they run; started, and ready, by ``launcher(config,
    world_size, weights)``."""

    def call(self, name: str, *args):
        """Run ``LearnerRank.call(name, args)`` on every rank at once and return rank 0's value; a rank that
        fails or ends is a ``RuntimeError`` naming the call, one that does not answer in time a ``WaitTimeout``."""

    def close(self) -> None:
        """Stop the ranks and release what they hold (processes, actors, reserved resources)."""


Launcher = Callable[[Config, int, dict], Ranks]


class ShardedLMLearner:
    """The ``LMLearner`` interface (prepare, update, set_lr_fraction, restore, lr_factor) over a learner sharded
    across ``world_size`` ranks started by ``launcher``; its checkpoints are sharded (``state``, ``save_shards``,
    ``load_shards``) instead of ``LMLearner.checkpoint``'s tensors."""

    def __init__(self, policy: LMPolicy, config: Config, world_size: int, launcher: Launcher):
        self.policy, self.config = policy, config
        self._ranks = launcher(config, world_size, _cpu_state(policy))
        self._lr_factor = 1.0

    def prepare(self, batch: LMBatch) -> dict[str, float]:
        metrics, fields = self._ranks.call("prepare", batch)
        for name, value in fields.items():
            setattr(batch, name, value)
        return metrics

    def update(self, batch: LMBatch) -> dict[str, float]:
        metrics, weights = self._ranks.call("update", batch)
        self._load_trained(weights)
        return metrics

    def _load_trained(self, weights: dict[str, torch.Tensor]) -> None:
        """The trained weights rank 0 sent, into the driver's policy."""
        with torch.no_grad():
            unexpected = self.policy.load_state_dict(weights, strict=False).unexpected_keys
        if unexpected:
            raise RuntimeError(f"the learner ranks sent a weight the policy lacks: {unexpected[0]}")

    def set_lr_fraction(self, fraction: float) -> float:
        return self._ranks.call("set_lr_fraction", fraction)

    @property
    def lr_factor(self) -> float:
        return self._lr_factor

    @lr_factor.setter
    def lr_factor(self, value: float) -> None:
        self._lr_factor = self._ranks.call("set_lr_factor", value)

    def state(self) -> dict:
        """The learner's state beyond its tensors, as JSON (``LMLearner.state``); its optimizer's is in the shards."""
        return self._ranks.call("state")

    def save_shards(self, directory: Path) -> None:
        """Every rank writes its shards of the trainable weights, the optimizer's state and the float32 masters into
        ``directory`` (``unipg.learn.distributed.save_sharded``); returns once all have, their files fsynced."""
        self._ranks.call("save_shards", str(directory))

    def load_shards(self, directory: Path, state: dict) -> None:
        """Set the learner back to the shards in ``directory`` (written by any number of ranks) and the JSON
        ``state``; the driver's policy gets the restored trained weights, as after an update."""
        self._lr_factor, weights = self._ranks.call("load_shards", str(directory), state)
        self._load_trained(weights)

    def restore(self, tensors: dict[str, torch.Tensor], state: dict) -> None:
        """Set the learner back to a one-process checkpoint's optimizer ``tensors`` and ``state``, and its ranks'
        weights to the driver's policy (restored first)."""
        self._lr_factor = self._ranks.call("restore", tensors, state, _cpu_state(self.policy))

    def close(self) -> None:
        self._ranks.close()


def _cpu_state(policy: LMPolicy) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().cpu() for name, tensor in policy.state_dict().items()}


class LearnerRank:
    """One rank of the sharded learner, the same in a local process and in a Ray actor. ``start`` joins the
    process group (rank 0 listening at ``host:port``) and builds the sharded policy and its ``LMLearner``;
    ``call`` runs one driver call, on every rank together (calls run collectives), and returns its value on
    rank 0, None on the others."""

    def __init__(self, rank: int, world_size: int, config: Config, weights: dict[str, torch.Tensor]):
        self.rank, self.world_size, self.config, self.weights = rank, world_size, config, weights
        self.learner: LMLearner | None = None

    def start(self, host: str, port: int) -> None:
        from unipg.policy.loading import policy_from_config

        torch.set_num_threads(self.config.threads or 1)
        device = rank_device(self.config.device, self.rank)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)  # NCCL binds a rank to the current device
        self.config = self.config.model_copy(update={"device": device})
        init_group(self.rank, self.world_size, host, port, device=device, timeout=self.config.train.learner_timeout)
        policy = policy_from_config(self.config)
        policy.load_state_dict(self.weights)
        self.weights = None
        # Ranks must run the same collectives, in step: prompt sharing runs the model twice on a micro-batch
        # that repeats a prompt (a GRPO group) and once on one that does not (say, a rank's one-row empty
        # pass), which would put one rank's all-gathers against another's reduce-scatters for good.
        for module in (policy, policy.critic):
            if module is not None:
                module.share_prompts = False
        for module in (policy.model, policy.critic, policy._reference):
            if module is not None:
                shard_model(module)
        if policy.value_head is not None:
            from torch.distributed.fsdp import fully_shard

            fully_shard(policy.value_head)
        self.learner = LMLearner(policy, self.config)

    def call(self, name: str, args: tuple = ()):
        try:
            result = _run(self.learner, name, args)
        except RuntimeError as error:
            if not _collective_timed_out(error):
                raise
            raise WaitTimeout.after(
                f"learner rank {self.rank} of {self.world_size} waited in a collective of '{name}' for a peer that did "
                "not join it",
                self.config.train.learner_timeout,
                "train.learner_timeout",
                STUCK_HINT,
            ) from error
        if name == "stop":
            torch.distributed.destroy_process_group()
        return result if self.rank == 0 else None


def _collective_timed_out(error: RuntimeError) -> bool:
    """Whether ``error`` is a collective that waited past the process group's timeout: gloo raises a RuntimeError
    "[.../gloo/...] Timed out waiting 1800000ms for recv operation to complete", torch's own code a ``DistError``."""
    text = str(error).lower()
    return "timed out" in text and (isinstance(error, torch.distributed.DistError) or "gloo" in text)


def rank_device(device: str, rank: int) -> str:
    """The device of one learner rank: on CUDA a GPU of its own, the rank-th one where the process sees several
    (local processes on one machine), ``cuda:0`` where it sees one (a Ray actor, given its GPU); ``auto`` is CUDA
    where this machine has it, else the CPU; others as set."""
    if device == "auto":
        device = str(resolve_device(device))
    if not device.startswith("cuda"):
        return device
    return f"cuda:{rank}" if torch.cuda.device_count() > 1 else "cuda:0"


class LocalRanks:
    """``Ranks`` as ``world_size`` spawned processes on this machine, each serving its ``rank_type`` (a
    ``LearnerRank``) over its own pipe, with the rendezvous on the loopback address; every call waits at most
    ``timeout`` seconds (``train.learner_timeout``) for the answers."""

    def __init__(
        self, config: Config, world_size: int, weights: dict[str, torch.Tensor], rank_type: type = LearnerRank
    ):
        import torch.multiprocessing as mp

        context, port = mp.get_context("spawn"), free_port()
        self._pipes, self._processes = [], []
        self.timeout, self._stuck = config.train.learner_timeout, False  # stuck: a call timed out, ranks hang
        for rank in range(world_size):
            mine, theirs = context.Pipe()
            self._pipes.append(mine)
            self._processes.append(
                context.Process(
                    target=_serve,
                    daemon=True,
                    args=(rank_type(rank, world_size, config, weights), "127.0.0.1", port, theirs),
                )
            )
        for process in self._processes:
            process.start()
        try:
            self.call("ready")
        except BaseException:
            self.close()
            raise

    def call(self, name: str, *args):
        """Rank 0's value once every rank has answered, at most ``timeout`` seconds: a ``WaitTimeout`` naming the
        ranks that did not answer in time (or the rank whose collective timed out), a ``RuntimeError`` naming the
        call when a rank failed or ended."""
        for pipe in self._pipes:
            pipe.send((name, args))
        replies, waiting = {}, list(self._pipes)
        deadline = time.monotonic() + self.timeout
        while waiting:
            for pipe in wait(waiting, timeout=min(1.0, max(deadline - time.monotonic(), 0.0))):
                kind, value = pipe.recv()
                if kind == "error":
                    raise RuntimeError(f"the sharded learner failed in '{name}': {value}")
                if kind == "timeout":  # the rank's collective timed out: a peer is stuck
                    self._stuck = True
                    raise WaitTimeout(value)
                replies[self._pipes.index(pipe)] = value
                waiting.remove(pipe)
            if waiting and any(not process.is_alive() for process in self._processes):
                raise RuntimeError(f"a learner process ended during '{name}'; see its traceback above")
            if waiting and time.monotonic() >= deadline:
                self._stuck = True
                late = [str(self._pipes.index(pipe)) for pipe in waiting]
                ranks = f"learner rank{'s' if len(late) > 1 else ''} {', '.join(late)} of {len(self._pipes)}"
                what = "start (join the process group, load the model)" if name == "ready" else f"answer '{name}'"
                raise WaitTimeout.after(
                    f"{ranks} did not {what}",
                    self.timeout,
                    "train.learner_timeout",
                    STUCK_HINT,
                )
        return replies[0]

    def close(self) -> None:
        """Stop the ranks: ask them to, unless a call timed out (they would not answer), then end any still running."""
        if self._processes and not self._stuck and all(process.is_alive() for process in self._processes):
            try:
                self.call("stop")
            except (RuntimeError, WaitTimeout):
                pass  # a rank failed and said so, or does not answer; all are ended below
        for process in self._processes:
            process.join(timeout=0 if self._stuck else 30)
            if process.is_alive():
                process.terminate()
                process.join()
        self._processes = []


def _serve(rank: LearnerRank, host: str, port: int, pipe) -> None:
    """A local rank's process: start, then answer the driver's calls until ``stop``."""
    try:
        rank.start(host, port)
        while True:
            name, args = pipe.recv()
            result = None if name == "ready" else rank.call(name, args)
            pipe.send(("ok", result))
            if name == "stop":
                return
    except WaitTimeout as error:  # reported to the driver, which raises it; the rank has nothing more to say
        pipe.send(("timeout", str(error)))
    except Exception as error:  # noqa: BLE001 — reported to the driver, which raises it
        pipe.send(("error", f"{type(error).__name__}: {error}"))
        raise


def _run(learner: LMLearner, name: str, args: tuple):
    """What one call does on every rank; the value is what rank 0 sends back."""
    if name == "stop":
        return None
    if name == "prepare":
        batch = args[0]
        metrics = learner.prepare(batch)
        return metrics, {field: _on_cpu(getattr(batch, field)) for field in PREPARED}
    if name == "update":
        metrics = learner.update(args[0])
        return metrics, _trained_state(learner.policy)
    if name == "set_lr_fraction":
        return learner.set_lr_fraction(*args)
    if name == "set_lr_factor":
        learner.lr_factor = args[0]
        return learner.lr_factor
    if name == "state":
        return learner.state(IN_SHARDS)
    if name == "save_shards":
        save_sharded(args[0], learner.policy, learner.optimizer, learner.masters)
        return None
    if name == "load_shards":
        directory, state = args
        load_sharded(directory, learner.policy, learner.optimizer, learner.masters)
        learner.restore_state(state)
        return learner.lr_factor, _trained_state(learner.policy)
    if name == "restore":
        tensors, state, weights = args
        _load_full_weights(learner.policy, weights)
        _load_sharded_optimizer(learner.optimizer, tensors, state["optimizer"])
        learner.masters.unstash(learner.optimizer)  # else the next step writes the old masters back
        learner.restore_state(state)
        return learner.lr_factor
    raise ValueError(f"unknown learner call '{name}'")


def _trained_state(policy: nn.Module) -> dict[str, torch.Tensor]:
    """The full weights of the parameters training changes, buffers left out (collective: all ranks call)."""
    trained = {name for name, parameter in policy.named_parameters() if parameter.requires_grad}
    return {name: tensor for name, tensor in full_state_dict(policy, trained_only=True).items() if name in trained}


def _on_cpu(value):
    """``value`` on the CPU if it is a tensor: what a rank sends to the driver must be, since the driver sends
    it on to the ranks again (the prepared fields, in the batch of ``update``) and torch cannot send a CUDA
    tensor it received from another process."""
    return value.cpu() if isinstance(value, torch.Tensor) else value


def _load_sharded_optimizer(optimizer: torch.optim.Optimizer, tensors: dict, meta: dict) -> None:
    """Load a one-process optimizer checkpoint into an optimizer over sharded parameters."""
    from torch.distributed.tensor import distribute_tensor

    captured = {}
    load_optimizer(types.SimpleNamespace(load_state_dict=captured.update), tensors, meta)
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    for index, entry in captured["state"].items():
        parameter = parameters[index]
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor):
                continue
            if hasattr(parameter, "device_mesh") and value.shape == parameter.shape:
                entry[key] = distribute_tensor(value, parameter.device_mesh, parameter.placements)
            else:  # a local rank received it in memory it shares with the other ranks: AdamW's step adds up in place
                entry[key] = value.clone()
    keep_implementation(captured["param_groups"], optimizer)
    optimizer.load_state_dict(captured)


def _load_full_weights(module: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, weights, options=StateDictOptions(full_state_dict=True))
