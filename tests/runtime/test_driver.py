"""The text runtime: synchronous training is its staleness-0 case; the bound holds with real episodes."""

import threading
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.configs import CALCULATOR_AGENT as AGENT
from tests.helpers.configs import DETERMINISTIC_PPO as SMALL
from unipg.config import load_config
from unipg.learn.lm import LMBatch, LMLearner
from unipg.observe.metrics import read_metrics
from unipg.policy.loading import load_lm_policy, policy_from_config
from unipg.runtime.driver import RolloutReport, Runtime, serve_one_by_one
from unipg.runtime.lm import train_lm
from unipg.runtime.prompts import PromptSampler
from unipg.runtime.replay import Group, ProducerFailed
from unipg.runtime.setup import seed_everything, set_threads
from unipg.sample.episodes import EpisodeRunner
from unipg.tasks.base import make_task
from unipg.tasks.rewards.rules import build_rewards


def synchronous_reference(config):
    """The textbook synchronous loop, written out: sample a batch with the current weights, prepare, update."""
    seed_everything(config.seed, config.deterministic)
    set_threads(config)
    task = make_task(config.task.name, **config.task.options)
    policy = policy_from_config(config)
    runner = EpisodeRunner(policy, task, config, build_rewards(task.rewards))
    learner = LMLearner(policy, config)
    sampler, generator = PromptSampler(task.train, config.seed), torch.Generator().manual_seed(config.seed)
    losses = []
    for update in range(1, config.train.updates + 1):
        learner.set_lr_fraction(1.0)
        examples = sampler.next(config.prompts_per_step)
        group = config.sample.samples_per_prompt
        trajectories = runner.run(
            [e for e in examples for _ in range(group)], generator=generator, policy_version=update - 1
        ).trajectories
        batch = LMBatch.from_trajectories(trajectories, policy.pad_id)
        learner.prepare(batch)
        losses.append(learner.update(batch)["loss"])
    return policy, losses


@pytest.mark.e2e
@pytest.mark.parametrize("schedule", ["sequential", "concurrent"])
def test_staleness_zero_gives_the_same_updates_as_synchronous_training(embedded_path, tmp_path, schedule):
    """Both schedules, bit for bit: the concurrent one samples on its own thread with a copy of the weights,
    which computes exactly what the learner's model would."""
    config = load_config(
        None,
        SMALL
        + [
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            f"runtime.schedule={schedule}",
            "runtime.max_staleness=0",
        ],
    )
    reference, reference_losses = synchronous_reference(config)
    result = train_lm(config)
    records = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    assert all(r["async/staleness_trajectory_max"] == 0 and r["async/staleness_token_max"] == 0 for r in records)
    trained = load_lm_policy(str(result.run_dir / "policy"), value_head=True).model.state_dict()
    assert [r["train/loss"] for r in records] == reference_losses
    assert all(torch.equal(trained[name], value) for name, value in reference.model.state_dict().items())


@pytest.mark.e2e
def test_sequential_staleness_trains_every_step_on_data_exactly_eta_versions_old(embedded_path, tmp_path):
    config = load_config(
        None,
        SMALL
        + [
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            "runtime.max_staleness=2",
            "runtime.schedule=sequential",
            "train.updates=5",
            "estimator.policy_loss=decoupled_ppo",
            "estimator.off_policy_weight=age_decay",
        ],
    )
    records = [r for r in read_metrics(train_lm(config).run_dir) if "train/loss" in r]
    assert [r["async/staleness_trajectory_max"] for r in records] == [0, 1, 2, 2, 2]
    assert [r["async/staleness_token_mean"] for r in records] == [0, 1, 2, 2, 2]
    # decoupled PPO's π_prox/μ: exactly 1 on fresh data (π_prox = μ), not on data two versions old
    assert records[0]["train/behaviour_weight_mean"] == 1.0 and records[-1]["train/behaviour_weight_mean"] != 1.0
    last = records[-1]
    assert last["async/buffer_trajectories"] == 3 * 8  # η + 1 steps' worth before the step takes its own
    assert last["train/weights_weight_mean"] == pytest.approx(0.99**2)
    assert 0 < last["train/importance_ess"] <= 1


@pytest.mark.e2e
def test_concurrent_agent_training_keeps_every_token_within_the_bound(embedded_path, tmp_path):
    """Episodes with heavy-tailed tool latency run on a background thread while the learner trains."""
    config = load_config(
        None,
        AGENT
        + [
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            "runtime.max_staleness=1",
            "runtime.schedule=concurrent",
        ],
    )
    records = [r for r in read_metrics(train_lm(config).run_dir) if "train/loss" in r]
    assert len(records) == 4
    for record in records:
        assert record["async/staleness_trajectory_max"] <= 1 and record["async/staleness_token_max"] <= 1
        assert record["async/buffer_occupancy"] <= 1 and record["async/dropped_stale"] == 0
        assert 0 <= record["timing/learner_idle_fraction"] <= 1 and "timing/weight_sync" in record
        assert "rollout/tool_calls" in record and record["rollout/turns"] >= 1


@pytest.mark.e2e
def test_a_failing_rollout_stops_the_run_with_its_error(embedded_path, tmp_path, monkeypatch):
    import unipg.runtime.backends.local_lm as lm_rollout

    config = load_config(
        None,
        SMALL
        + [
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            "runtime.max_staleness=1",
            "runtime.schedule=concurrent",
            "deterministic=false",
        ],
    )

    make_env = lm_rollout.EpisodeRunner.make_env

    def broken(self, *args, **kwargs):  # evaluation (main thread) works, rollout (its own thread) fails
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("environment crashed")
        return make_env(self, *args, **kwargs)

    monkeypatch.setattr(lm_rollout.EpisodeRunner, "make_env", broken)
    with pytest.raises(
        ValueError,
        match=r"rollout failed: RuntimeError: environment crashed; no update had "
        r"finished; the metrics so far are in",
    ) as raised:
        train_lm(config)
    assert isinstance(raised.value.__cause__, ProducerFailed)
    trace = str(raised.value).rsplit("(traceback: ", 1)[1].rstrip(")")  # the one line names the whole traceback
    assert "Traceback" in open(trace).read() and "in broken" in open(trace).read()


def test_a_buffer_too_small_for_one_batch_is_refused_at_config_load_before_a_run_folder_exists(embedded_path, tmp_path):
    overrides = SMALL + [
        f"model.name={embedded_path}",
        f"log.output_dir={tmp_path}",
        "log.run_name=tiny-buffer",
        "runtime.max_staleness=1",
    ]
    for size in (1, 4):
        with pytest.raises(
            ValueError,
            match=rf"replay_buffer_size \({size}\) cannot hold one learner step's batch "
            r"of 8 trajectories; set it to at least 16",
        ):
            load_config(None, overrides + [f"sample.replay_buffer_size={size}"])
    assert list(tmp_path.iterdir()) == []
    load_config(None, overrides + ["sample.replay_buffer_size=8"])  # one batch is enough to train


def test_the_runtime_still_refuses_a_buffer_too_small_for_one_batch():
    with pytest.raises(ValueError, match=r"replay_buffer_size \(4\) cannot hold one learner step's batch of 8"):
        Runtime(None, groups_per_step=2, group_size=4, max_staleness=0, capacity=4)


class ScriptedRollout:
    """Groups whose episodes score as scripted (a list of returns per group, in order), produced now or served."""

    def __init__(self, script, group_size=2):
        self.script, self.group_size, self.asked = iter(script), group_size, 0

    def produce(self, count, version):
        self.asked += count
        return [
            Group([SimpleNamespace(reward=r) for r in next(self.script)], version, self.group_size)
            for _ in range(count)
        ]

    def serve(self, gate, buffer, stop):
        serve_one_by_one(self, gate, buffer, stop, self.group_size)

    def publish(self, version):
        pass

    def report(self):
        return RolloutReport()


@pytest.mark.parametrize("schedule", ["sequential", "concurrent"])
def test_dynamic_sampling_replaces_groups_that_scored_alike_with_fresh_ones(schedule):
    from unipg.runtime.lm_run import mixed_returns

    alike, mixed = [1.0, 1.0], [0.0, 1.0]
    rollout = ScriptedRollout([alike, mixed, [0.0, 0.0], mixed] + [mixed] * 20)
    with Runtime(
        rollout,
        groups_per_step=2,
        group_size=2,
        max_staleness=0,
        capacity=8,
        schedule=schedule,
        keep=mixed_returns,
        filter_budget=2,
    ) as runtime:
        groups, step = runtime.next_groups(0)
    metrics = step.metrics()
    assert [[t.reward for t in g.items] for g in groups] == [mixed, mixed]
    assert metrics["async/filtered"] == 4 and metrics["async/staleness_trajectory_max"] == 0
    if schedule == "sequential":
        assert rollout.asked == 4  # two groups, then the two that replace the rejected ones


def test_dynamic_sampling_trains_on_alike_groups_once_its_budget_is_spent():
    from unipg.runtime.lm_run import mixed_returns

    rollout = ScriptedRollout([[0.0, 0.0]] * 20)
    runtime = Runtime(
        rollout, groups_per_step=2, group_size=2, max_staleness=0, capacity=8, keep=mixed_returns, filter_budget=3
    )
    for version in range(2):  # the budget is per step
        groups, step = runtime.next_groups(version)
        runtime.publish(version + 1)
        assert len(groups) == 2 and step.metrics()["async/filtered"] == 6
    assert rollout.asked == 10


def test_dynamic_sampling_is_refused_for_an_estimator_that_is_not_group_relative(embedded_path, tmp_path):
    overrides = SMALL + [f"model.name={embedded_path}", f"log.output_dir={tmp_path}", "sample.dynamic_sampling=true"]
    with pytest.raises(
        ValueError,
        match=r"sample.dynamic_sampling drops groups whose group-relative advantages "
        r"are zero; estimator.advantage 'gae'.*use one of dr_grpo, .*grpo, .*rloo",
    ):
        load_config(None, overrides)


@pytest.mark.e2e
def test_a_grpo_run_with_dynamic_sampling_reports_the_episodes_it_dropped(embedded_path, tmp_path):
    config = load_config(
        None,
        SMALL
        + [
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            "algorithm=grpo",
            "sample.dynamic_sampling=true",
            "sample.dynamic_sampling_budget=0.5",
        ],
    )
    records = [r for r in read_metrics(train_lm(config).run_dir) if "train/loss" in r]
    assert len(records) == 3
    for record in records:  # at most one group of 4 dropped per step (half of the step's two groups)
        assert record["async/filtered"] in (0, 4) and record["async/staleness_trajectory_max"] == 0
        if record["async/filtered"] == 0:
            assert record["rollout/uniform_group_fraction"] == 0
