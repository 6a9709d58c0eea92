"""Checkpoints of a gymnasium run: everything ``train_gym`` needs to continue, under ``<run>/checkpoints``.

A checkpoint is taken between two rollout segments and holds the policy and optimizer tensors, the learner's
mini-batch generator, the run's counters and evaluation history, the global Python/NumPy/torch generators,
the environments' state (``GymRollout.state_dict``: each environment's plain attributes and ``np_random``,
the latest observations, unfinished episodes' returns and the reward normalisation), the replay buffer's
generator and the runtime figures not yet logged. On the sequential schedule a run resumed from it continues
bit for bit on CPU for environments whose state lives in plain attributes (gymnasium's classic control).

It also records how many metrics records the run had written, so that a resumed run cuts metrics.jsonl back
to exactly those (``keep_metrics``), less the closing evaluation and log line of a run's last update, which a
longer run does not have.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import torch

from unipg.checkpoint.files import Checkpoint, tensor_mismatch
from unipg.checkpoint.lm import CHECKPOINT_DIR
from unipg.checkpoint.store import CheckpointStore
from unipg.config.lm import CheckpointConfig
from unipg.learn.state import restore_rng, rng_state
from unipg.observe.metrics import read_metrics
from unipg.policy.mlp import MLPActorCritic
from unipg.sample.gym_rollout import GymRollout


class GymLearner(Protocol):
    def checkpoint(self) -> tuple[dict[str, torch.Tensor], dict]: ...

    def restore(self, tensors: dict[str, torch.Tensor], state: dict) -> None: ...


class GymCheckpointer:
    """Saves and restores a gym run's objects under ``run_dir/checkpoints``; the driver passes its counters."""

    def __init__(
        self,
        run_dir: Path,
        settings: CheckpointConfig,
        env_id: str,
        policy: MLPActorCritic,
        learner: GymLearner,
        rollout: GymRollout,
        replay_random=None,
    ):
        """``replay_random``: the replay buffer's ``random.Random``, saved and restored with the run."""
        self.store = CheckpointStore(
            run_dir / CHECKPOINT_DIR,
            keep_last=settings.keep_last,
            keep_best=int(settings.keep_best),
            best_metric=settings.best_metric,
        )
        self.every_updates = settings.every_updates
        self.env_id, self.policy, self.learner, self.rollout = env_id, policy, learner, rollout
        self.replay_random = replay_random

    def due(self, update: int, last: bool) -> bool:
        """Whether ``update`` saves: every ``checkpoint.every_updates`` updates, and the last one."""
        return last or (self.every_updates > 0 and update % self.every_updates == 0)

    def save(
        self,
        update: int,
        run_state: dict,
        *,
        pending: list[tuple[dict, torch.Tensor, torch.Tensor]],
        metrics: dict[str, float],
    ) -> Path:
        """A checkpoint after ``update``; ``run_state``: the driver's JSON counters; ``pending``: runtime figures
        (record, ages, masks) not logged yet; ``metrics``: this update's evaluation, which ranks it."""
        optimizer, learner_state = self.learner.checkpoint()
        tensors = {"policy": self.policy.state_dict(), "optimizer": optimizer}
        if pending:
            tensors["pending"] = {
                f"{kind}.{index}": tensor.contiguous()
                for index, (_, ages, masks) in enumerate(pending)
                for kind, tensor in (("age", ages), ("mask", masks))
            }
        state = {
            "update": update,
            "env_id": self.env_id,
            "run": run_state,
            "learner": learner_state,
            "rollout": self.rollout.state_dict(),
            "rng": rng_state(),
            "pending": [record for record, _, _ in pending],
            "replay_random": _random_state(self.replay_random),
        }
        return self.store.save(update, tensors, state, metrics=metrics)

    def restore(self, checkpoint: Checkpoint) -> tuple[dict, list[tuple[dict, torch.Tensor, torch.Tensor]]]:
        """Load ``checkpoint`` into the run's objects; returns (the driver's counters, pending runtime figures)."""
        state = checkpoint.state
        try:
            if state.get("env_id") != self.env_id:
                raise ValueError(f"it was written for {state.get('env_id')}, the configuration asks for {self.env_id}")
            problem = tensor_mismatch(checkpoint.tensors["policy"], self.policy.state_dict())
            if problem:
                raise ValueError(f"policy: {problem}")
            self.policy.load_state_dict(checkpoint.tensors["policy"])
            self.learner.restore(checkpoint.tensors["optimizer"], state["learner"])
            self.rollout.load_state_dict(state["rollout"])
            restore_rng(state["rng"])
            if self.replay_random is not None and state["replay_random"] is not None:
                version, internal, gauss = state["replay_random"]
                self.replay_random.setstate((version, tuple(internal), gauss))
            saved = checkpoint.tensors.get("pending", {})
            pending = [
                (record, saved[f"age.{index}"], saved[f"mask.{index}"]) for index, record in enumerate(state["pending"])
            ]
            return state["run"], pending
        except (KeyError, TypeError, ValueError, RuntimeError) as error:
            raise ValueError(
                f"checkpoint {checkpoint.path} does not fit this run ({type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else error!r}); resume with the run's own "
                "config.yaml, leaving env.*, policy.* and the algorithm as they were"
            ) from None


def _random_state(generator) -> list | None:
    if generator is None:
        return None
    version, internal, gauss = generator.getstate()
    return [version, list(internal), gauss]


def keep_metrics(run_dir: Path, count: int, *, dropped: list[int] = ()) -> None:
    """Cut metrics.jsonl back to its first ``count`` records, less those at the indices ``dropped`` (a last
    update's closing evaluation and log line): a resumed run writes what follows again."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    records = read_metrics(run_dir)
    kept = [record for index, record in enumerate(records[:count]) if index not in set(dropped)]
    if len(kept) < len(records):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(record) + "\n" for record in kept), encoding="utf-8")
        tmp.replace(path)
