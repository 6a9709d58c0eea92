import json

import pytest
import torch

from tests.helpers.configs import tiny_lm_overrides
from unipg.config import ConfigError, load_config
from unipg.config.run import MixSchedule, OfflineConfig
from unipg.learn.lm_batch import LMBatch
from unipg.observe.metrics import read_metrics
from unipg.policy.loading import load_lm_policy
from unipg.runtime.lm import train_lm
from unipg.runtime.offline import OfflineData, behaviour_at_load, mix_share
from unipg.sample.episode_records import read_episode_records, trajectory_from_record
from unipg.sample.episodes import EpisodeRunner
from unipg.tasks.base import make_task
from unipg.tasks.rewards.rules import build_rewards

SMALL = tiny_lm_overrides(
    "train.micro_batch_size=8", "train.updates=2", "eval.every_updates=2", "eval.pass_k=0", "algorithm=grpo", num_test=4
)


def test_mix_share_is_constant_or_linear_then_flat():
    assert mix_share(0.25, 7) == 0.25
    schedule = MixSchedule(start=0.5, end=0.0, updates=20)
    assert [mix_share(schedule, u) for u in (1, 11, 21, 40)] == [0.5, 0.25, 0.0, 0.0]


@pytest.mark.e2e
def test_a_run_writes_its_episodes_and_a_second_run_trains_on_them(embedded_path, tmp_path):
    first = train_lm(
        load_config(
            None,
            SMALL
            + [f"model.name={embedded_path}", f"log.output_dir={tmp_path}", "log.run_name=first", "log.episodes=true"],
        )
    )
    records = read_episode_records(first.run_dir / "episodes.jsonl")
    assert len(records) == 16 and {r["update"] for r in records} == {1, 2}
    record = records[0]
    assert record["messages"][0]["role"] == "user" and record["messages"][1]["role"] == "assistant"
    assert len(record["behaviour_logprobs"]) == len(record["token_ids"]) == len(record["loss_mask"])

    second = train_lm(
        load_config(
            None,
            SMALL
            + [
                f"model.name={embedded_path}",
                f"log.output_dir={tmp_path}",
                "log.run_name=second",
                f"data.offline={{path: {first.run_dir / 'episodes.jsonl'}, mix: 0.5}}",
                "estimator.off_policy_weight=age_decay",
                "estimator.sample_age_decay=0.5",
            ],
        ),
        log=lambda text: None,
    )
    steps = [r for r in read_metrics(second.run_dir) if "offline/share" in r]
    assert [r["offline/share"] for r in steps] == [0.5, 0.5]
    # version −1: age = learner version + 1, so the age-decay weight halves every update
    assert [r["offline/age_mean"] for r in steps] == [1.0, 2.0]
    assert [r["offline/mean_weight"] for r in steps] == pytest.approx([0.5, 0.25])
    assert second.samples == 16  # the batch kept its size: half of it offline
    assert all(
        r["rollout/episodes_started"] <= 8 for r in read_metrics(second.run_dir) if "rollout/episodes_started" in r
    )


def test_records_without_tokens_are_tokenised_like_rollouts_with_the_initial_policy_as_mu(embedded_path):
    config = load_config(None, SMALL + [f"model.name={embedded_path}"])
    policy = load_lm_policy(embedded_path)
    task = make_task("arithmetic", digits=1, num_train=40, num_test=4)
    runner = EpisodeRunner(policy, task, config, build_rewards(task.rewards))
    record = {
        "prompt": "3+4=",
        "messages": [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}],
        "reward": 1.0,
        "correct": True,
    }
    trajectory = trajectory_from_record(
        record, encode=runner.encoder_for(None), template=runner.template, vocab_size=len(policy.tokenizer)
    )
    assert trajectory.prompt_ids == runner.encode("3+4=") and trajectory.offline
    assert trajectory.step_rewards == [1.0] and trajectory.policy_versions == [-1] and trajectory.correct
    assert sum(trajectory.loss_mask) == len(trajectory.token_ids) >= 1
    behaviour_at_load(policy, [trajectory], temperature=1.0, micro_batch=4)
    assert len(trajectory.behaviour_logprobs) == len(trajectory.token_ids)
    assert all(value < 0 for value in trajectory.behaviour_logprobs)


def test_a_records_side_trajectories_load_as_rows_beside_it_and_bad_ones_are_named(embedded_path, tmp_path):
    config = load_config(None, SMALL + [f"model.name={embedded_path}"])
    policy = load_lm_policy(embedded_path)
    task = make_task("arithmetic", digits=1, num_train=40, num_test=4)
    runner = EpisodeRunner(policy, task, config, build_rewards(task.rewards))
    side = {
        "prompt": "3+4=",
        "messages": [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "8"}],
        "reward": 0.0,
    }
    record = {
        **side,
        "messages": [side["messages"][0], {"role": "assistant", "content": "7"}],
        "reward": 1.0,
        "side": [side],
    }
    trajectory = trajectory_from_record(
        record, encode=runner.encoder_for(None), template=runner.template, vocab_size=len(policy.tokenizer)
    )
    assert len(trajectory.side) == 1 and trajectory.side[0].turn_texts == ["8"] and trajectory.side[0].offline
    rows = [trajectory, *trajectory.side]
    behaviour_at_load(policy, rows, temperature=1.0, micro_batch=4)
    assert all(len(t.behaviour_logprobs) == len(t.token_ids) for t in rows)
    assert len(LMBatch.from_trajectories([trajectory], policy.pad_id).scores) == 2
    bad = tmp_path / "bad.jsonl"
    for side_value, problem in (
        ("x", "'side' must be a list"),
        ([{"messages": []}], "side trajectory 1: 'messages'"),
        ([{**side, "side": []}], "side trajectory 1: a side trajectory has no 'side'"),
    ):
        bad.write_text(json.dumps({**record, "side": side_value}) + "\n")
        with pytest.raises(ConfigError, match=problem):
            read_episode_records(bad)


def test_offline_groups_are_one_prompt_each_and_the_share_leaves_one_fresh_group(embedded_path):
    config = load_config(None, SMALL + [f"model.name={embedded_path}"])
    policy = load_lm_policy(embedded_path)
    task = make_task("arithmetic", digits=1, num_train=40, num_test=4)
    runner = EpisodeRunner(policy, task, config, build_rewards(task.rewards))
    records = [
        {
            "prompt": p,
            "messages": [{"role": "user", "content": p}, {"role": "assistant", "content": "1"}],
            "reward": float(i % 2),
        }
        for p in ("1+0=", "2-1=")
        for i in range(3)
    ]
    trajectories = [
        trajectory_from_record(r, encode=runner.encode, template=runner.template, vocab_size=len(policy.tokenizer))
        for r in records
    ]
    data = OfflineData(
        OfflineConfig(path="x.jsonl", mix=1.0, age=3), trajectories, group_size=4, groups_per_step=3, seed=0
    )
    assert data.count(1) == 2  # all but one group
    groups = data.take(2, version=5)
    assert all(len({t.example.prompt for t in g.items}) == 1 and len(g.items) == 4 for g in groups)
    assert all(t.policy_versions == [2] for g in groups for t in g.items)  # fixed age 3 at version 5


def test_bad_offline_files_are_config_errors(tmp_path):
    missing = tmp_path / "none.jsonl"
    with pytest.raises(ConfigError, match="is not a file"):
        read_episode_records(missing)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "assistant", "content": "7"}], "reward": 1}) + "\n")
    with pytest.raises(ConfigError, match="line 1: 'messages' must start"):
        read_episode_records(bad)
    bad.write_text(
        json.dumps(
            {
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                "reward": 1,
                "token_ids": [1],
            }
        )
        + "\n"
    )
    with pytest.raises(ConfigError, match="token ids need all of"):
        read_episode_records(bad)
    with pytest.raises(ConfigError, match="raise train.batch_size"):
        load_config(None, SMALL + ["train.batch_size=4", "train.mini_batch_size=4", "data.offline={path: x.jsonl}"])
    with pytest.raises(ConfigError, match="mix"):
        load_config(None, SMALL + ["data.offline={path: x.jsonl, mix: 1.5}"])


def test_the_runtime_starts_fewer_rollouts_when_a_step_takes_offline_groups():
    from unipg.runtime.driver import RolloutReport, Runtime
    from unipg.runtime.replay import Group

    class Counting:
        produced = []

        def produce(self, count, version):
            self.produced.append(count)
            return [Group([torch.zeros(1)] * 2, version, 2) for _ in range(count)]

        def publish(self, version):
            pass

        def report(self):
            return RolloutReport()

    rollout = Counting()
    runtime = Runtime(rollout, groups_per_step=3, group_size=2, max_staleness=0, capacity=12)
    groups, _ = runtime.next_groups(0, 1)
    runtime.publish(1)
    groups_again, _ = runtime.next_groups(1)
    assert (len(groups), len(groups_again), rollout.produced) == (1, 3, [1, 3])


def test_records_of_roles_the_task_does_not_have_are_left_out_or_refused(embedded_path, tmp_path):
    from unipg.runtime.offline import load_offline

    path = tmp_path / "team.jsonl"
    line = {
        "prompt": "3+4=",
        "messages": [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}],
        "reward": 1.0,
    }
    path.write_text("\n".join(json.dumps({**line, "role": role}) for role in ("checker", None)) + "\n")
    config = load_config(None, SMALL + [f"model.name={embedded_path}", f"data.offline={{path: {path}}}"])
    policy = load_lm_policy(embedded_path)
    task = make_task("arithmetic", digits=1, num_train=40, num_test=4)
    runner = EpisodeRunner(policy, task, config, build_rewards(task.rewards))
    said = []
    data = load_offline(config, runner, policy, log=said.append)
    assert [t.role for roles in data.by_prompt.values() for ts in roles.values() for t in ts] == [None]
    assert any("1 of 2 episodes are of roles this task does not have" in text for text in said)
    path.write_text(json.dumps({**line, "role": "checker"}) + "\n")
    with pytest.raises(ConfigError, match="no episode is of a role of task 'arithmetic'"):
        load_offline(config, runner, policy, log=said.append)
