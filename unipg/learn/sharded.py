"""``train.learner_processes`` > 1: the lm learner sharded with FSDP2 over local processes, behind the
``LMLearner`` interface, so that the driver, the rollout and the checkpoints do not change.

The driver's process keeps its unsharded policy, on which rollout and evaluation run as with one process.
The learner runs in ``N`` spawned processes (ranks) that start from that policy's weights, shard it
(``unipg.learn.distributed.shard_model``) and each run an ``LMLearner`` on every batch, taking a share of the
micro-batches. Rank 0 receives each call from the driver's ``ShardedLMLearner`` over a pipe and broadcasts it
to the other ranks. After every update the ranks gather the full weights once, and the handle loads them into
the driver's policy: what the inference side samples from and what checkpoints save. The optimizer's state is
gathered into the one-process layout for a checkpoint and sharded again on restore, so a checkpoint resumes
with any number of processes.

The ranks are started with the ``spawn`` method: a script that calls ``unipg.train`` with learner processes
must do so under ``if __name__ == "__main__":`` (the command line does).
"""

from __future__ import annotations

import types

import torch
from torch import nn

from unipg.config import Config
from unipg.learn.distributed import free_port, full_state_dict, init_local_group, shard_model
from unipg.learn.lm import LMBatch, LMLearner
from unipg.learn.state import load_optimizer, optimizer_tensors
from unipg.policy.lm import LMPolicy

# LMBatch fields that ``prepare`` computes, sent back to the driver's copy of the batch.
PREPARED = ("proximal_logprobs", "reference_logprobs", "values", "advantages", "returns")


def make_learner(policy: LMPolicy, config: Config) -> LMLearner | ShardedLMLearner:
    """The run's learner: in this process, or sharded over ``train.learner_processes`` processes."""
    processes = config.train.learner_processes
    return LMLearner(policy, config) if processes == 1 else ShardedLMLearner(policy, config, processes)


class ShardedLMLearner:
    """The ``LMLearner`` interface (prepare, update, set_lr_fraction, checkpoint, restore, lr_factor) over a
    learner sharded across ``processes`` local processes."""

    def __init__(self, policy: LMPolicy, config: Config, processes: int):
        import torch.multiprocessing as mp

        self.policy, self.config = policy, config
        context = mp.get_context("spawn")
        self._pipe, child = context.Pipe()
        port, weights = free_port(), {k: v.detach().cpu() for k, v in policy.state_dict().items()}
        self._ranks = [context.Process(target=_rank_main, daemon=True,
                                       args=(rank, processes, port, config, weights, child if rank == 0 else None))
                       for rank in range(processes)]
        for process in self._ranks:
            process.start()
        self._call("ready")
        self._lr_factor = 1.0

    def _call(self, name: str, *args):
        self._pipe.send((name, args))
        while not self._pipe.poll(1.0):
            if any(not process.is_alive() for process in self._ranks):
                raise RuntimeError(f"a learner process ended during '{name}'; see its traceback above")
        kind, value = self._pipe.recv()
        if kind == "error":
            raise RuntimeError(f"the sharded learner failed in '{name}': {value}")
        return value

    def prepare(self, batch: LMBatch) -> dict[str, float]:
        metrics, fields = self._call("prepare", batch)
        for name, value in fields.items():
            setattr(batch, name, value)
        return metrics

    def update(self, batch: LMBatch) -> dict[str, float]:
        metrics, weights = self._call("update", batch)
        with torch.no_grad():
            self.policy.load_state_dict(weights)
        return metrics

    def set_lr_fraction(self, fraction: float) -> float:
        return self._call("set_lr_fraction", fraction)

    @property
    def lr_factor(self) -> float:
        return self._lr_factor

    @lr_factor.setter
    def lr_factor(self, value: float) -> None:
        self._lr_factor = self._call("set_lr_factor", value)

    def checkpoint(self) -> tuple[dict[str, torch.Tensor], dict]:
        return self._call("checkpoint")

    def restore(self, tensors: dict[str, torch.Tensor], state: dict) -> None:
        """Set the learner back to a checkpoint, and its ranks' weights to the driver's policy (restored first)."""
        weights = {k: v.detach().cpu() for k, v in self.policy.state_dict().items()}
        self._lr_factor = self._call("restore", tensors, state, weights)

    def close(self) -> None:
        if any(process.is_alive() for process in self._ranks):
            self._call("stop")
        for process in self._ranks:
            process.join(timeout=30)


def _rank_main(rank: int, world_size: int, port: int, config: Config, weights: dict, pipe) -> None:
    """One rank: build and shard the policy, then run the calls rank 0 receives and broadcasts."""
    import torch.distributed as dist

    from unipg.policy.loading import policy_from_config

    torch.set_num_threads(config.threads or 1)
    init_local_group(rank, world_size, port, device=config.device)
    policy = policy_from_config(config)
    policy.load_state_dict(weights)
    for module in (policy.model, policy.critic, policy._reference):
        if module is not None:
            shard_model(module)
    if policy.value_head is not None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(policy.value_head)
    learner = LMLearner(policy, config)
    while True:
        message = [pipe.recv() if rank == 0 else None]
        dist.broadcast_object_list(message, src=0)
        name, args = message[0]
        try:
            result = _run(learner, name, args)
        except Exception as error:  # noqa: BLE001 — reported to the driver, which raises it
            if rank == 0:
                pipe.send(("error", f"{type(error).__name__}: {error}"))
            raise
        if rank == 0:
            pipe.send(("ok", result))
        if name == "stop":
            dist.destroy_process_group()
            return


def _run(learner: LMLearner, name: str, args: tuple):
    """What one call does on every rank; the value is what rank 0 sends back."""
    if name in ("ready", "stop"):
        return None
    if name == "prepare":
        batch = args[0]
        metrics = learner.prepare(batch)
        return metrics, {field: getattr(batch, field) for field in PREPARED}
    if name == "update":
        metrics = learner.update(args[0])
        return metrics, full_state_dict(learner.policy)
    if name == "set_lr_fraction":
        return learner.set_lr_fraction(*args)
    if name == "set_lr_factor":
        learner.lr_factor = args[0]
        return learner.lr_factor
    if name == "checkpoint":
        gathered = _gathered_optimizer_state(learner.optimizer)
        tensors, optimizer_meta = optimizer_tensors(types.SimpleNamespace(state_dict=lambda: gathered))
        return tensors, learner.state(optimizer_meta)
    if name == "restore":
        tensors, state, weights = args
        _load_full_weights(learner.policy, weights)
        _load_sharded_optimizer(learner.optimizer, tensors, state["optimizer"])
        learner.restore_state(state)
        return learner.lr_factor
    raise ValueError(f"unknown learner call '{name}'")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _gathered_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with every sharded state tensor gathered whole (collective: all ranks call)."""
    state_dict = optimizer.state_dict()
    state = {index: {key: _full(value) if isinstance(value, torch.Tensor) else value for key, value in entry.items()}
             for index, entry in sorted(state_dict["state"].items())}
    return {"state": state, "param_groups": state_dict["param_groups"]}


def _load_sharded_optimizer(optimizer: torch.optim.Optimizer, tensors: dict, meta: dict) -> None:
    """Load a one-process optimizer checkpoint into an optimizer over sharded parameters."""
    from torch.distributed.tensor import distribute_tensor

    captured = {}
    load_optimizer(types.SimpleNamespace(load_state_dict=captured.update), tensors, meta)
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    for index, entry in captured["state"].items():
        parameter = parameters[index]
        for key, value in entry.items():
            if hasattr(parameter, "device_mesh") and isinstance(value, torch.Tensor) and value.shape == parameter.shape:
                entry[key] = distribute_tensor(value, parameter.device_mesh, parameter.placements)
    optimizer.load_state_dict(captured)


def _load_full_weights(module: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, weights, options=StateDictOptions(full_state_dict=True))
