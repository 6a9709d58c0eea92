"""No silent hang: every wait on another process or thread ends at its setting with a ``WaitTimeout`` that names
what was waited on, where, for how long and the setting to raise (docs/robustness.md, "Waits and their timeouts").
Each hang is injected (a wait on an event nobody sets), and each timeout is tiny: the tests assert what is raised,
never how long it took."""

from __future__ import annotations

import asyncio
import functools
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from unipg.config import load_config
from unipg.config.timeouts import WaitTimeout
from unipg.inference.vllm import VLLMEngine
from unipg.inference.vllm_core import StepLoop
from unipg.learn.distributed import init_group, sum_across_ranks
from unipg.learn.sharded import LearnerRank, LocalRanks
from unipg.runtime.driver import Runtime
from unipg.runtime.replay import ProducerFailed
from unipg.runtime.stopping import waited_too_long

NEVER = threading.Event()  # set by no one: what an injected hang waits on


# -- learner ranks (train.learner_processes > 1) -----------------------------------------------------------------


class StuckLearner:
    """A learner whose ``set_lr_fraction`` hangs on rank 1 and, with ``collective``, sums over the ranks on rank 0."""

    def __init__(self, rank: int, collective: bool):
        self.rank, self.collective = rank, collective

    def set_lr_fraction(self, fraction: float) -> float:
        if self.rank == 1:
            NEVER.wait()
        return sum_across_ranks({"fraction": fraction})["fraction"] if self.collective else fraction


class StuckRank(LearnerRank):
    """A ``LearnerRank`` without a model: it joins a process group (once both ranks are up, behind ``barrier``, so
    that the rendezvous itself never waits) when ``collective`` is set, with the config's ``train.learner_timeout``."""

    def __init__(self, rank, world_size, config, weights, *, barrier=None, collective_timeout: float | None = None):
        super().__init__(rank, world_size, config, weights)
        self.barrier, self.collective_timeout = barrier, collective_timeout

    def start(self, host: str, port: int) -> None:
        torch.set_num_threads(1)
        if self.barrier is not None:
            self.barrier.wait()
            train = self.config.train.model_copy(update={"learner_timeout": self.collective_timeout})
            self.config = self.config.model_copy(update={"train": train})
            init_group(self.rank, self.world_size, host, port, timeout=self.config.train.learner_timeout)
        self.learner = StuckLearner(self.rank, collective=self.barrier is not None)


def ranks_config(timeout: float):
    return load_config(None, [f"train.learner_timeout={timeout}"])


def test_a_learner_rank_that_does_not_answer_a_call_ends_the_wait_naming_it():
    ranks = LocalRanks(ranks_config(120), 2, {}, rank_type=StuckRank)  # spawning takes seconds: a roomy start
    try:
        ranks.timeout = 0.5  # train.learner_timeout, as a call sees it
        with pytest.raises(WaitTimeout) as raised:
            ranks.call("set_lr_fraction", 1.0)
    finally:
        ranks.close()  # the stuck rank is ended, not asked to stop
    assert str(raised.value).startswith(
        "learner rank 1 of 2 did not answer 'set_lr_fraction' within train.learner_timeout=0.5 s: a rank may be stuck"
    )
    assert ranks._processes == []


def test_a_rank_whose_peer_never_joins_a_collective_ends_the_wait_naming_the_collective():
    import torch.multiprocessing as mp

    barrier = mp.get_context("spawn").Barrier(2)
    rank_type = functools.partial(StuckRank, barrier=barrier, collective_timeout=1.0)
    ranks = LocalRanks(ranks_config(120), 2, {}, rank_type=rank_type)  # the driver's own wait is the roomy one
    try:
        with pytest.raises(WaitTimeout) as raised:
            ranks.call("set_lr_fraction", 1.0)
    finally:
        ranks.close()
    message = str(raised.value)
    assert message.startswith(
        "learner rank 0 of 2 waited in a collective of 'set_lr_fraction' for a peer that did not join it within "
        "train.learner_timeout=1 s"
    )


# -- the concurrent schedule's handoff (runtime.rollout_timeout) ----------------------------------------------------


class StuckRollout:
    """A rollout whose thread never writes a group."""

    def serve(self, gate, buffer, stop) -> None:
        NEVER.wait()

    def publish(self, version: int) -> None:
        pass


def test_a_concurrent_rollout_that_writes_no_group_fails_the_learners_wait_and_is_left_behind():
    runtime = Runtime(
        StuckRollout(),
        groups_per_step=1,
        group_size=2,
        max_staleness=1,
        capacity=8,
        schedule="concurrent",
        rollout_timeout=0.5,
    ).start()
    try:
        with pytest.raises(ProducerFailed) as raised:
            runtime.next_groups(0)
    finally:
        runtime.close()  # returns at once: the stuck thread is not joined
    assert isinstance(raised.value.__cause__, WaitTimeout)
    assert str(raised.value).startswith(
        "the rollout thread (unipg-rollout) wrote no group of the step from version 0 within "
        "runtime.rollout_timeout=0.5 s: an episode or the inference engine may be stuck"
    )


# -- the vllm engine's stepping thread (sample.engine_timeout) -----------------------------------------------------


class StuckEngine:
    """A vLLM ``LLMEngine`` stand-in whose step and weight reload never return."""

    def add_request(self, *args, **kwargs) -> None:
        pass

    def abort_request(self, ids) -> None:
        pass

    def step(self):
        NEVER.wait()

    def collective_rpc(self, *args, **kwargs):
        NEVER.wait()


def test_a_turn_whose_engine_step_never_returns_fails_with_the_engine_timeout():
    loop = StepLoop(StuckEngine(), timeout=0.5)

    async def turn():
        answer = asyncio.get_running_loop().create_future()
        loop.submit([1, 2, 3], None, lambda output, error: None)
        return await loop.wait(answer, "a turn")

    with pytest.raises(WaitTimeout) as raised:
        asyncio.run(turn())
    assert str(raised.value).startswith(
        "the vllm engine's thread (unipg-vllm-steps) made no progress while a turn waited on it within "
        "sample.engine_timeout=0.5 s"
    )


def test_a_weight_sync_whose_reload_never_returns_fails_with_the_engine_timeout():
    llm = StuckEngine()
    engine = SimpleNamespace(
        lora=False, partial=False, llm=llm, loop=StepLoop(llm, timeout=0.5), _counters={}, version=0
    )
    engine._reload = functools.partial(VLLMEngine._reload, engine)
    with pytest.raises(WaitTimeout, match="while loading the weights of version 3 waited on it within sample"):
        asyncio.run(VLLMEngine.load(engine, 3, torch.nn.Linear(2, 2)))
    assert engine.version == 0


# -- what the run and the command line make of it -------------------------------------------------------------------


def test_a_learner_timeout_says_which_checkpoint_the_run_continues_from(tmp_path):
    timeout = WaitTimeout.after("learner rank 1 of 2 did not answer 'update'", 0.5, "train.learner_timeout")
    run = SimpleNamespace(saved=4, run_dir=tmp_path)
    assert str(waited_too_long(timeout, run)) == (
        f"learner rank 1 of 2 did not answer 'update' within train.learner_timeout=0.5 s; the newest checkpoint, "
        f"of update 4, is in {tmp_path}; continue with: unipg train --resume {tmp_path}"
    )
    placed = WaitTimeout("the rollout thread ...; a checkpoint of update 2 is in RUN")
    placed.__cause__ = ProducerFailed("the rollout thread ...")
    assert waited_too_long(placed, run) is placed  # rollout_failed saved a checkpoint and said so already


def test_the_command_line_prints_a_timeout_as_one_error_without_a_traceback(monkeypatch, tmp_path: Path):
    from unipg import api
    from unipg.cli import app

    def stuck_run(*args, **kwargs):
        raise WaitTimeout.after("learner rank 1 of 2 did not answer 'update'", 0.5, "train.learner_timeout")

    monkeypatch.setattr(api, "run", stuck_run)
    result = CliRunner().invoke(app, ["train", f"log.output_dir={tmp_path}"])
    assert result.exit_code == 2
    assert "error: learner rank 1 of 2 did not answer 'update' within train.learner_timeout=0.5 s" in result.output
    assert "Traceback" not in result.output


@pytest.mark.e2e
def test_a_run_whose_concurrent_rollout_gets_stuck_stops_with_a_checkpoint_of_its_last_update(
    embedded_path, tmp_path, monkeypatch
):
    from tests.helpers.configs import tiny_lm_overrides
    from unipg.checkpoint.files import load_checkpoint
    from unipg.checkpoint.store import CheckpointStore
    from unipg.runtime.lm import train_lm
    from unipg.runtime.replay import ReplayBuffer

    config = load_config(
        None,
        tiny_lm_overrides(
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            "runtime.max_staleness=1",
            "runtime.schedule=concurrent",
            "train.updates=3",
            "checkpoint.every_updates=1",
        ),
    )
    written, put, publish = [], ReplayBuffer.put, Runtime.publish

    def put_until_the_third_group(buffer, group):  # on the rollout thread: the third group's write never returns
        written.append(group)
        if len(written) > 2:
            NEVER.wait()
        put(buffer, group)

    def publish_then_wait_briefly(runtime, version):  # the first update waited as long as it needed
        publish(runtime, version)
        runtime.rollout_timeout = 0.5

    monkeypatch.setattr(ReplayBuffer, "put", put_until_the_third_group)
    monkeypatch.setattr(Runtime, "publish", publish_then_wait_briefly)
    with pytest.raises(WaitTimeout) as raised:
        train_lm(config)
    message = str(raised.value)
    assert message.startswith(
        "the rollout thread (unipg-rollout) wrote no group of the step from version 1 within "
        "runtime.rollout_timeout=0.5 s"
    )
    run_dir = next(tmp_path.iterdir())
    assert f"a checkpoint of update 1 is in {run_dir}; continue with: unipg train --resume {run_dir}" in message
    assert load_checkpoint(CheckpointStore(run_dir / "checkpoints").latest()).step == 1
