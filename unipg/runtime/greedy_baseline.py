"""The greedy baseline of ReMax: one greedy (temperature 0) episode per prompt of a learner step, not trained on.

An advantage estimator that reads ``greedy_scores`` (``needs_greedy_baseline``: remax) compares each sampled episode
with the greedy response to its prompt. The lm driver runs those episodes once per update, after it takes the
step's groups from the runtime and before the learner prepares the batch (``unipg.runtime.lm.train_step``), and
here is why there and not in the rollout:

- one place serves every schedule and backend (sequential, concurrent, Ray workers), since the groups reach the
  learner through the driver in all of them;
- the greedy episodes run on the driver's episode runner, the one the sequential schedule's rollout and every
  evaluation use: the run's inference engine (``sample.engine``) with ``runner.sampling(greedy=True)``, in the
  task's environment, scored by the run's reward function, exactly as a greedy evaluation episode;
- they decode with the weights the update starts from: the greedy response of the π_θ being trained, as in the
  paper, also when the groups were sampled by older weights (asynchronous training), where a baseline that does
  not depend on the sample keeps the gradient unbiased;
- they never enter the replay buffer, the admission gate, the episode counts, the episode log or the batch; only
  their rewards do (``LMBatch.greedy_scores``).

The baseline is the greedy episode's return (the sum of its step rewards, as a sampled episode's score); with
``estimator.kl_in_reward`` the sampled score also pays the KL to the reference, which the greedy one does not
(its tokens are not scored by the reference). The concurrent schedule's rollout goes on while the greedy episodes
run, on the learner's thread; their seconds are ``timing/greedy_baseline``.
"""

from __future__ import annotations

import statistics

import torch

from unipg.runtime.replay import Group
from unipg.sample.episodes import EpisodeRunner

METRICS_PREFIX = "greedy"  # the environment service's counts of the greedy episodes: greedy/tool_calls, ...


def greedy_baseline(runner: EpisodeRunner, groups: list[Group], version: int) -> tuple[torch.Tensor, dict[str, float]]:
    """For each training row of ``groups`` (group after group, each episode's rows, as ``rollout_batch`` lays them
    out) the return of the greedy episode of its group's prompt, of the row's role in a multi-role task: (B,).
    One greedy episode per group (one per role) runs on ``runner`` with the weights of ``version``. Also their
    metrics: ``rollout/greedy_reward_mean`` and the environment service's counts of those episodes."""
    examples = [group.items[0].example for group in groups]
    greedy = runner.run(
        examples, params=runner.sampling(greedy=True), generator=None, policy_version=version, all_roles=True
    ).trajectories
    per_prompt = len(greedy) // len(examples)  # one trajectory per role of the task (one for a one-role task)
    returns = {
        (index, trajectory.role): trajectory.reward
        for index in range(len(examples))
        for trajectory in greedy[index * per_prompt : (index + 1) * per_prompt]
    }
    rows = [
        returns[index, episode.role]
        for index, group in enumerate(groups)
        for episode in group.items
        for _ in episode.rows
    ]
    metrics = {"rollout/greedy_reward_mean": statistics.fmean(t.reward for t in greedy)}
    metrics.update(runner.pop_service_metrics(METRICS_PREFIX))
    return torch.tensor(rows, dtype=torch.float32), metrics
