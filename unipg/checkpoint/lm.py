"""Checkpoints of an lm run: everything ``train_lm`` needs to continue bit for bit, under
``<run>/checkpoints``, and finding the newest intact one of an earlier run to resume from."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from unipg.checkpoint.files import Checkpoint, load_checkpoint, tensor_mismatch
from unipg.checkpoint.shards import weight_shapes
from unipg.checkpoint.store import CheckpointStore
from unipg.config.lm import CheckpointConfig
from unipg.learn.distributed import frozen_parameter_names, load_sharded
from unipg.learn.state import generator_state, restore_generator, restore_rng, rng_state
from unipg.observe.metrics import read_metrics
from unipg.policy.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_config_json,
    adapter_tensors,
    has_adapter,
    load_adapter_tensors,
    role_adapter_names,
)

if TYPE_CHECKING:  # the language-model stack (transformers) is imported by the lm runs that use these
    from unipg.learn.lm import LMLearner
    from unipg.policy.lm import LMPolicy


class Resumable(Protocol):
    """Anything whose position a checkpoint keeps as JSON (the prompt sampler of a run)."""

    def state(self) -> dict: ...

    def check_state(self, state: dict) -> None: ...

    def load_state(self, state: dict) -> None: ...


CHECKPOINT_DIR = "checkpoints"


class LMCheckpointer:
    """Saves and restores everything an lm run needs to continue bit for bit, under ``run_dir/checkpoints``.

    Not saved: the reference model, which is the frozen initial model; the state records its name
    (``reference_model``) and a resumed run rebuilds it from the configuration. When ``estimator.ref_sync_steps``
    moves the reference towards the policy it is no longer that model, and its weights are saved (``reference``)
    and restored over the rebuilt one. With LoRA the policy's base
    weights are that model too: only the adapter is saved, in the PEFT format (``adapter_model.safetensors``
    and ``adapter_config.json``), so the checkpoint folder loads with ``PeftModel.from_pretrained``. With an
    adapter per role (``agent.role_policy: adapters``) each role's is saved as ``adapter_model.<role>.safetensors``
    and ``adapter_config.<role>.json``, and the optimizer's state holds every role's.

    With a sharded learner (``train.learner_processes`` > 1) the ranks write the weights and the optimizer's state
    as shards (``unipg.checkpoint.files``: a sharded checkpoint); such a checkpoint resumes with any number of
    ranks, one process included, and a one-process checkpoint resumes on ranks.
    """

    def __init__(
        self,
        run_dir: Path,
        settings: CheckpointConfig,
        model_name: str,
        policy: LMPolicy,
        learner: LMLearner,
        sampler: Resumable,
        generator: torch.Generator,
    ):
        """``settings``: section ``checkpoint``; ``model_name``: the configured model, which is the reference."""
        self.store = CheckpointStore(
            run_dir / CHECKPOINT_DIR,
            keep_last=settings.keep_last,
            keep_best=int(settings.keep_best),
            best_metric=settings.best_metric,
        )
        self.model_name, self.policy, self.learner = model_name, policy, learner
        self.sampler, self.generator = sampler, generator

    def save(
        self,
        update: int,
        *,
        samples: int,
        train_seconds: float,
        history: list[tuple[int, dict[str, float]]],
        metrics: dict[str, float],
        episodes: dict[str, int] | None = None,
    ) -> Path:
        """A checkpoint of the run after ``update``; ``metrics`` (this update's evaluation, if any) rank it;
        ``episodes``: the rollout's episode counts, which a resumed run continues (None: the rollout keeps none)."""
        from unipg.learn.sharded import ShardedLMLearner  # here: a gym run finds its checkpoints without transformers

        tensors, extra_files, shards = {}, None, None
        if isinstance(self.learner, ShardedLMLearner):  # the ranks write every tensor, each its own shards
            learner_state, shards = self.learner.state(), self.learner.save_shards
        else:
            tensors, extra_files, learner_state = self._tensor_groups()
        state = {
            "update": update,
            "policy_version": update,
            "samples": samples,
            "train_seconds": train_seconds,
            "eval_history": [[at, evaluation] for at, evaluation in history],
            "learner": learner_state,
            "sampler": self.sampler.state(),
            "rollout_generator": generator_state(self.generator),
            "rng": rng_state(),
            "reference_model": self.model_name,
        }
        if episodes is not None:
            state["episodes"] = episodes
        path = self.store.save(update, tensors, state, metrics=metrics, extra_files=extra_files, shards=shards)
        if update > 0:  # the checkpoint of update 0 (see rollback) is needed only until the run saves its own
            self.store.remove(0)
        return path

    def _tensor_groups(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, bytes] | None, dict]:
        """A one-process checkpoint's tensor groups, its extra files (a LoRA adapter's config) and the learner's
        JSON state."""
        optimizer, learner_state = self.learner.checkpoint()
        model, extra_files = self.policy.model, None
        if has_adapter(model):
            adapters = adapter_groups(model)
            tensors = {group: adapter_tensors(model, name) for group, name in adapters.items()}
            tensors["optimizer"] = optimizer
            extra_files = {
                adapter_config_file(group): adapter_config_json(model, name) for group, name in adapters.items()
            }
        else:
            tensors = {"policy": model.state_dict(), "optimizer": optimizer}
        if self.policy.value_head is not None:
            tensors["value_head"] = self.policy.value_head.state_dict()
        if self.policy.critic is not None:
            tensors["critic"] = self.policy.critic.state_dict()
        if self.learner.config.estimator.ref_sync_steps is not None:
            tensors["reference"] = self.policy.reference_model.state_dict()
        return tensors, extra_files, learner_state

    def restore(self, checkpoint: Checkpoint) -> tuple[int, float, list[tuple[int, dict[str, float]]]]:
        """Load ``checkpoint`` into the run's objects; returns (samples, train_seconds, eval history).

        A checkpoint of another model (other parameter names or shapes, a value head or critic added or
        removed) raises a ValueError naming both models and the first differing tensor."""
        state = checkpoint.state
        if isinstance(state.get("sampler"), dict):
            self.sampler.check_state(state["sampler"])
        try:
            if checkpoint.sharded:
                self._restore_shards(checkpoint.path, state["learner"])
            else:
                self._restore_tensors(checkpoint.tensors, state["learner"])
        except (RuntimeError, KeyError, ValueError, TypeError) as error:
            raise ValueError(
                f"checkpoint {checkpoint.path} does not fit the configured model: it was written for "
                f"{state.get('reference_model', 'an unrecorded model')}, the configuration asks for "
                f"{self.model_name} ({str(error).splitlines()[0]}); resume with the run's own "
                "config.yaml, leaving model.* as it was"
            ) from None
        try:
            self.sampler.load_state(state["sampler"])
            restore_generator(self.generator, state["rollout_generator"])
            restore_rng(state["rng"])
            history = [(at, evaluation) for at, evaluation in state["eval_history"]]
            return state["samples"], state["train_seconds"], history
        except (KeyError, TypeError, ValueError, RuntimeError) as error:  # a state.json from another program
            raise ValueError(
                f"checkpoint {checkpoint.path} has an incomplete run state ({type(error).__name__}: "
                f"{error}); it was not written by train_lm, so resume from a checkpoint that "
                "was"
            ) from None

    def _restore_tensors(self, tensors: dict[str, dict[str, torch.Tensor]], learner_state: dict) -> None:
        """A one-process checkpoint's tensor groups into the policy, then into the learner with its JSON state."""
        lora = has_adapter(self.policy.model)
        if lora != any(group.startswith(ADAPTER_WEIGHTS) for group in tensors):
            raise ValueError("the run's model.lora_rank setting changed since the checkpoint was saved")
        if lora:  # the base weights are the configured model, loaded already
            adapters = adapter_groups(self.policy.model)
            if not adapters.keys() <= tensors.keys():
                raise ValueError("the run's agent.role_policy setting changed since the checkpoint was saved")
            for group, name in adapters.items():
                load_adapter_tensors(self.policy.model, tensors[group], name)
        for group in ("value_head", "critic") if lora else ("policy", "value_head", "critic"):
            module = self.policy.model if group == "policy" else getattr(self.policy, group)
            if (module is None) != (group not in tensors):
                raise ValueError(f"the run's model.{group} setting changed since the checkpoint was saved")
            if module is None:
                continue
            problem = tensor_mismatch(tensors[group], module.state_dict())
            if problem:
                raise ValueError(f"{group}: {problem}")
            module.load_state_dict(tensors[group])
        if "reference" in tensors:
            self._restore_reference(tensors["reference"])
        self.learner.restore(tensors["optimizer"], learner_state)

    def _restore_shards(self, path: Path, learner_state: dict) -> None:
        """A sharded checkpoint into the learner, its shapes checked against the policy's first: on ranks, each
        loads its shards and the driver's policy gets the trained weights; in one process, this process loads them
        all into the policy and the learner."""
        from unipg.learn.sharded import ShardedLMLearner

        frozen = frozen_parameter_names(self.policy)
        expected = {name: tensor for name, tensor in self.policy.state_dict().items() if name not in frozen}
        problem = tensor_mismatch(weight_shapes(path), expected)
        if problem:
            raise ValueError(problem)
        if isinstance(self.learner, ShardedLMLearner):
            self.learner.load_shards(path, learner_state)
        else:
            load_sharded(path, self.policy, self.learner.optimizer, self.learner.masters)
            self.learner.restore_state(learner_state)

    def _restore_reference(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load a moved reference (``estimator.ref_sync_steps``) over the one rebuilt from the configured model."""
        reference = self.policy.reference_model
        if reference is None:
            raise ValueError(
                "the checkpoint holds a moved reference model and the run's model.reference setting holds none"
            )
        problem = tensor_mismatch(tensors, reference.state_dict())
        if problem:
            raise ValueError(f"reference: {problem}")
        reference.load_state_dict(tensors)


def adapter_groups(model) -> dict[str, str]:
    """The checkpoint's tensor group of each adapter of a LoRA ``model``: ``adapter_model`` for its one adapter,
    ``adapter_model.<role>`` for each role's (``agent.role_policy: adapters``)."""
    roles = role_adapter_names(model)
    return {f"{ADAPTER_WEIGHTS}.{role}": role for role in roles} if roles else {ADAPTER_WEIGHTS: "default"}


def adapter_config_file(group: str) -> str:
    """The ``adapter_config.json`` beside an adapter's tensor group (``adapter_config.<role>.json`` for a role's)."""
    return ADAPTER_CONFIG.replace(".json", group.removeprefix(ADAPTER_WEIGHTS) + ".json")


def latest_checkpoint(run_dir: Path) -> Checkpoint:
    """The newest intact checkpoint of an earlier run; ``ValueError`` saying what to do if there is none."""
    if not (run_dir / "config.yaml").is_file():
        raise ValueError(
            f"cannot resume from '{run_dir}': it is not a run folder (no config.yaml); pass the folder "
            "that `unipg train` created for the run, e.g. runs/grpo-arithmetic-seed0-<time>"
        )
    store = CheckpointStore(run_dir / CHECKPOINT_DIR)
    path = store.latest()
    if path is None:
        found = len(store.list())
        problem = (
            f"none of its {found} checkpoints is intact (see the warnings above)"
            if found
            else f"it holds no checkpoint ({run_dir / CHECKPOINT_DIR} is missing or empty: the run stopped "
            "before its first save)"
        )
        raise ValueError(
            f"cannot resume from '{run_dir}': {problem}; start a new run instead, or set "
            "checkpoint.every_updates so that runs save checkpoints as they go"
        )
    checkpoints = store.list()
    newer = [damaged.name for damaged in checkpoints[checkpoints.index(path) + 1 :]]
    if newer:  # left in place: a save that reaches their step sets them aside as damaged-*, never deletes them
        warnings.warn(
            f"resuming from {path.name}, the newest intact checkpoint; {', '.join(newer)} could not be "
            "used (see the warnings above) and stay where they are",
            RuntimeWarning,
            stacklevel=2,
        )
    return load_checkpoint(path)


def drop_metrics_after(run_dir: Path, update: int) -> None:
    """Remove the records of updates after ``update`` from metrics.jsonl: a resumed run writes them again."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    records = read_metrics(run_dir)
    kept = [record for record in records if record["step"] <= update]
    if len(kept) < len(records):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(record) + "\n" for record in kept), encoding="utf-8")
        tmp.replace(path)
