"""ReMax's greedy baseline in a run: one greedy episode per prompt, at temperature 0, on the run's engine and the
learner's weights, never trained on; and short runs, synchronous and asynchronous, on the embedded model."""

import math

import pytest
import torch

from tests.helpers.configs import tiny_lm_overrides
from unipg.config import load_config
from unipg.inference.hf import HFService
from unipg.observe.metrics import read_metrics
from unipg.runtime.greedy_baseline import greedy_baseline
from unipg.runtime.lm import train_lm, train_step
from unipg.runtime.lm_run import open_run
from unipg.runtime.replay import Group
from unipg.sample.agent import Trajectory
from unipg.sample.episodes import Episodes
from unipg.tasks.base import Example

PROMPTS, SAMPLES = 2, 2  # prompts per update, completions per prompt


class GreedyRunner:
    """A runner whose greedy episode of prompt ``p`` returns ``p`` for role "a" and ``p + 0.5`` for role "b"."""

    def __init__(self):
        self.runs = []

    def sampling(self, *, greedy: bool = False) -> str:
        return "greedy" if greedy else "sampled"

    def run(self, examples, *, params, generator, policy_version, all_roles):
        self.runs.append((params, [example.answer for example in examples], policy_version, all_roles))
        return Episodes(
            [episode(example, role) for example in examples for role in ("a", "b")], batch_sizes=[], generate_seconds=0
        )

    def pop_service_metrics(self, prefix: str) -> dict[str, float]:
        return {}


def episode(example: Example, role: str, side: int = 0) -> Trajectory:
    reward = float(example.answer) + (0.5 if role == "b" else 0.0)
    trajectory = Trajectory(example, [1], step_rewards=[reward], role=role)
    trajectory.side = [Trajectory(example, [1], role=role) for _ in range(side)]
    return trajectory


def test_every_row_reads_the_greedy_return_of_its_prompt_and_role():
    prompts = [Example(prompt=f"p{index}", answer=str(index), solution=str(index)) for index in (1, 2)]
    # two-role groups of two episodes, role after role; one episode of prompt 2 trains a side trajectory too
    groups = [
        Group(
            [episode(prompts[0], "a"), episode(prompts[0], "a"), episode(prompts[0], "b"), episode(prompts[0], "b")],
            3,
            2,
        ),
        Group(
            [
                episode(prompts[1], "a", side=1),
                episode(prompts[1], "a"),
                episode(prompts[1], "b"),
                episode(prompts[1], "b"),
            ],
            3,
            2,
        ),
    ]
    runner = GreedyRunner()
    rows, metrics = greedy_baseline(runner, groups, 3)
    assert runner.runs == [("greedy", ["1", "2"], 3, True)]  # one greedy episode per prompt, with every role's
    assert rows.tolist() == [1.0, 1.0, 1.5, 1.5, 2.0, 2.0, 2.0, 2.5, 2.5]
    assert metrics == {"rollout/greedy_reward_mean": pytest.approx((1.0 + 1.5 + 2.0 + 2.5) / 4)}


def remax_overrides(embedded_path, tmp_path, *changes: str) -> list[str]:
    return tiny_lm_overrides(
        "algorithm=remax",
        "train.micro_batch_size=4",
        "eval.pass_k=0",
        "checkpoint.every_updates=0",
        f"model.name={embedded_path}",
        f"log.output_dir={tmp_path}",
        *changes,
        num_test=4,
    )


@pytest.fixture
def generate_calls(monkeypatch) -> list[tuple[float, list[int], object]]:
    """Every request the HF engine answers: (its temperature, its context, the policy that answers it)."""
    calls = []
    generate = HFService.generate

    async def recorded(self, context_ids, *, max_new_tokens, order=0, params=None):
        calls.append(((params or self.params).temperature, list(context_ids), self.policy))
        return await generate(self, context_ids, max_new_tokens=max_new_tokens, order=order, params=params)

    monkeypatch.setattr(HFService, "generate", recorded)
    return calls


def test_one_greedy_episode_per_prompt_on_the_learners_weights_is_not_trained_on(
    embedded_path, tmp_path, generate_calls, one_torch_thread
):
    overrides = remax_overrides(
        embedded_path,
        tmp_path,
        f"train.batch_size={PROMPTS * SAMPLES}",
        f"train.mini_batch_size={PROMPTS * SAMPLES}",
        f"sample.samples_per_prompt={SAMPLES}",
        "deterministic=true",
    )
    run = open_run(load_config(None, overrides), None, None, None, lambda message: None)
    trained = []
    update = run.learner.update
    run.learner.update = lambda batch: trained.append(batch) or update(batch)
    try:
        run.runtime.reset(0)
        record, size, _ = train_step(
            run.runtime, run.learner, run.timer, 1, group_size=SAMPLES, tools=False, greedy=run.runner
        )
    finally:
        run.close()
    greedy = [call for call in generate_calls if call[0] == 0.0]
    sampled = [call for call in generate_calls if call[0] > 0.0]
    assert len(greedy) == PROMPTS and len(sampled) == PROMPTS * SAMPLES
    assert sorted(context for _, context, _ in sampled) == sorted(context for _, context, _ in greedy * SAMPLES)
    assert all(policy is run.policy for _, _, policy in greedy)  # the weights the update starts from
    # the trained batch holds the sampled completions only; its rows of one prompt share that prompt's greedy return
    (batch,) = trained
    assert size == len(batch.scores) == PROMPTS * SAMPLES
    assert record["rollout/episodes_finished"] == PROMPTS * SAMPLES
    by_prompt = batch.greedy_scores.reshape(PROMPTS, SAMPLES)
    assert torch.equal(by_prompt, by_prompt[:, :1].expand_as(by_prompt))
    assert record["rollout/greedy_reward_mean"] == pytest.approx(by_prompt[:, 0].mean().item())
    lengths = batch.completion_mask.sum(1)
    assert torch.allclose(batch.advantages.sum(1) / lengths, batch.scores - batch.greedy_scores)
    assert "timing/greedy_baseline" in record


@pytest.mark.e2e
@pytest.mark.parametrize(
    "schedule", [["runtime.max_staleness=0"], ["runtime.max_staleness=1", "runtime.schedule=concurrent"]]
)
def test_a_short_remax_run_trains_with_the_greedy_baseline(embedded_path, tmp_path, schedule):
    overrides = remax_overrides(embedded_path, tmp_path, "train.updates=2", "sample.samples_per_prompt=1", *schedule)
    config = load_config(None, overrides)
    assert (config.estimator.advantage, config.estimator.policy_loss) == ("remax", "vanilla")
    result = train_lm(config)
    assert result.updates == 2 and result.samples == 2 * config.train.batch_size
    records = [r for r in read_metrics(result.run_dir) if "train/policy_loss" in r]
    assert len(records) == 2
    for record in records:
        assert math.isfinite(record["train/policy_loss"]) and record["train/grad_norm"] >= 0
        assert math.isfinite(record["rollout/greedy_reward_mean"]) and "timing/greedy_baseline" in record
