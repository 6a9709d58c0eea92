"""Completions laid out for the learner: the ``LMBatch`` of (B, C) token tensors, and its advantages.

- the sequence reward sits on the last sampled token; with ``kl_in_reward`` each token also pays
  −β·KL_t to the reference (classic RLHF PPO, REINFORCE++), otherwise β·KL enters the loss (GRPO);
- the estimator's family comes from the inputs it declares (``advantage_family``). Group estimators (they read
  ``scores``: grpo, dr_grpo, rloo, opo, ...) see one score and length per *episode* (its first row's) in groups of
  ``samples_per_prompt`` episodes of one prompt, told apart by the rows' ``groups`` index (without it,
  consecutive episodes); an episode's advantage goes to every row of it (``episodes``). An episode may train
  several trajectories (an external agent that rewrote its history): each is a row of the loss's token or
  sequence mean, but the episode counts once in its group's baseline. An estimator that reads ``greedy_scores``
  (remax) also sees, for each episode, the reward of the greedy episode of its prompt (``LMBatch.greedy_scores``);
- step estimators (gae, reinforce_plus_plus, batch_mean_baseline, ...) see the (B, C) token rewards of every
  row with its episode ending at its last sampled token (optimal_token_baseline also each row's group, and the
  policy's μ log-probs and Σπ² of each token); turn estimators (they read ``turn_rewards``:
  turn_level) see one reward per policy turn of a multi-turn episode.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from unipg.config.schema import EstimatorConfig
from unipg.estimate import ADVANTAGES, advantage_family, needs_greedy_baseline
from unipg.estimate.advantages import broadcast_to_tokens
from unipg.estimate.kl import kl_penalty
from unipg.estimate.masked import masked_whiten, pack_masked, unpack_masked
from unipg.policy.lm import Generation, left_pad


@dataclass
class LMBatch:
    """B completions (rows); the episodes of one prompt form a group. C = completion length, L = P + C."""

    input_ids: torch.Tensor  # (B, L) left-padded prompt followed by the right-padded completion
    attention_mask: torch.Tensor  # (B, L) 1 on real tokens
    completion_mask: torch.Tensor  # (B, C) 1 on tokens the policy sampled
    behaviour_logprobs: torch.Tensor  # (B, C) log μ(a_t|s_t) at sampling time
    scores: torch.Tensor  # (B,) the sequence reward
    reference_logprobs: torch.Tensor | None = None  # (B, C) log π_ref(a_t|s_t)
    values: torch.Tensor | None = None  # (B, C) V(s_t) before the update
    advantages: torch.Tensor | None = None  # (B, C)
    returns: torch.Tensor | None = None  # (B, C) value-regression targets
    # Multi-turn episodes (None for single-turn completions): K = the most policy turns of any episode.
    token_turns: torch.Tensor | None = None  # (B, C) long, the policy turn of each sampled token, -1 elsewhere
    turn_rewards: torch.Tensor | None = None  # (B, K) reward of each policy turn, 0 past the last
    turn_mask: torch.Tensor | None = None  # (B, K) 1 on turns the episode had
    # Off-policy data (asynchronous training): None when every sample is from the learner's current weights.
    ages: torch.Tensor | None = None  # (B, C) learner version − version that sampled the token, 0 elsewhere
    proximal_logprobs: torch.Tensor | None = None  # (B, C) log π_prox: the weights the update starts from
    sum_pi_squared: torch.Tensor | None = None  # (B, C) Σ_v π_v² of the policy's distribution at each sampled token,
    # computed only for an estimator that reads it (optimal_token_baseline)
    # Episodes and groups (None: each row is an episode, in consecutive groups of ``samples_per_prompt``).
    episodes: torch.Tensor | None = None  # (B,) long, the episode of each row; its first row scores it
    groups: torch.Tensor | None = None  # (B,) long, the group (of one prompt, one role) of each row's episode
    truncated: torch.Tensor | None = None  # (B,) bool, the row was cut by a token limit rather than ended: a
    # generation's finish reason "length", an episode's finish "max_tokens"; None: unknown, none taken as cut
    greedy_scores: torch.Tensor | None = None  # (B,) the reward of the greedy (temperature 0) episode of the row's
    # prompt (of its role), the baseline of an estimator that reads it (remax); None: no greedy episode was run

    @classmethod
    def from_generation(cls, generation: Generation, scores: list[float]) -> LMBatch:
        return cls(
            input_ids=torch.cat([generation.prompt_ids, generation.completion_ids], dim=1),
            attention_mask=torch.cat([generation.prompt_mask, generation.completion_mask], dim=1),
            completion_mask=generation.completion_mask.float(),
            behaviour_logprobs=generation.behaviour_logprobs,
            scores=torch.tensor(scores, dtype=torch.float32),
            truncated=torch.tensor([reason == "length" for reason in generation.finish_reasons]),
        )

    @classmethod
    def from_trajectories(
        cls, episodes: list, pad_id: int, version: int | None = None, groups: list[int] | None = None
    ) -> LMBatch:
        """Episodes of the agent loop, a row per trajectory (each episode's own, then its ``side`` ones): the
        prompt left-padded, every later token right-padded; the loss mask (1 on sampled tokens only) is the
        completion mask. ``groups``: the group of each episode (None: consecutive groups). With the learner's
        ``version``, ``ages`` holds each sampled token's age (each turn records the weights version that
        sampled it)."""
        trajectories = [t for episode in episodes for t in episode.rows]
        episode_of_row = [index for index, episode in enumerate(episodes) for _ in episode.rows]
        prompt_ids, prompt_mask = left_pad([t.prompt_ids for t in trajectories], pad_id)
        width = max(max(len(t.token_ids) for t in trajectories), 1)
        turns = max(max(t.turns for t in trajectories), 1)
        ids = left_aligned([t.token_ids for t in trajectories], torch.long, pad_id, width)
        real = (torch.arange(width) < torch.tensor([len(t.token_ids) for t in trajectories])[:, None]).long()
        loss_mask = left_aligned([t.loss_mask for t in trajectories], torch.float32, 0, width)
        behaviour = left_aligned([t.behaviour_logprobs for t in trajectories], torch.float32, 0, width)
        token_turns = left_aligned([t.turn_of_token for t in trajectories], torch.long, -1, width)
        turn_rewards = left_aligned([t.step_rewards for t in trajectories], torch.float32, 0, turns)
        turn_mask = (torch.arange(turns) < torch.tensor([t.turns for t in trajectories])[:, None]).float()
        ages = None
        if version is not None:  # each sampled token's age: the version of its turn's weights, behind ``version``
            sampled_by = left_aligned([t.policy_versions if t.turns else [] for t in trajectories], torch.long, 0)
            token_versions = sampled_by.gather(1, token_turns.clamp(min=0))
            for row, trajectory in enumerate(trajectories):
                for index, later in trajectory.version_changes:  # a newer version took over inside the turn
                    rest = token_turns[row, index:] == token_turns[row, index]
                    token_versions[row, index:][rest] = later
            ages = (version - token_versions) * loss_mask * turn_mask[:, :1]
        return cls(
            input_ids=torch.cat([prompt_ids, ids], dim=1),
            attention_mask=torch.cat([prompt_mask, real], dim=1),
            completion_mask=loss_mask,
            behaviour_logprobs=behaviour,
            scores=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
            token_turns=token_turns,
            turn_rewards=turn_rewards,
            turn_mask=turn_mask,
            ages=ages,
            episodes=torch.tensor(episode_of_row, dtype=torch.long),
            groups=None if groups is None else torch.tensor(groups, dtype=torch.long)[episode_of_row],
            truncated=torch.tensor(
                [episodes[index].finish == "max_tokens" or episodes[index].cut for index in episode_of_row]
            ),
        )

    def move_to(self, device: torch.device) -> LMBatch:
        """Put every tensor of the batch on ``device``, in place (the learner's: where its model is); returns it."""
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor) and value.device != device:
                setattr(self, name, value.to(device))
        return self

    def loss_mask(self, mask_truncated: bool) -> torch.Tensor:
        """(B, C) the tokens the loss reads: the completion mask, without the rows of cut completions when
        ``mask_truncated`` (their advantages still count in their group's baseline)."""
        if not mask_truncated or self.truncated is None:
            return self.completion_mask
        return self.completion_mask * ~self.truncated[:, None].to(self.completion_mask.device)

    @property
    def completion_length(self) -> int:
        return self.completion_mask.shape[1]

    def rows(self, index: torch.Tensor) -> LMBatch:
        """The sub-batch of the given rows in batch order, with all-padding columns on either side dropped.

        Rows are taken in batch order whatever the order of ``index`` (the loss does not depend on it), so a
        micro-batch holding the same rows as a no-grad pass sees exactly the same tensors.
        """
        index = index.sort().values
        fields = {
            name: (value[index] if isinstance(value, torch.Tensor) else value) for name, value in vars(self).items()
        }
        sub = LMBatch(**fields)
        first_real = int(sub.attention_mask.argmax(dim=1).min())  # leftmost prompt token of any row
        prompt_width = sub.input_ids.shape[1] - sub.completion_length
        real = sub.attention_mask[:, prompt_width:]  # (b, C) sampled and inserted tokens after the prompt
        keep = max(
            int((real * torch.arange(1, real.shape[1] + 1, device=real.device)).max()), 1
        )  # last real column, 1-based
        drop = sub.completion_length - keep
        if first_real > 0 or drop > 0:
            end = sub.input_ids.shape[1] - drop
            sub.input_ids, sub.attention_mask = sub.input_ids[:, first_real:end], sub.attention_mask[:, first_real:end]
            for name in (
                "completion_mask",
                "behaviour_logprobs",
                "reference_logprobs",
                "values",
                "advantages",
                "returns",
                "token_turns",
                "ages",
                "proximal_logprobs",
                "sum_pi_squared",
            ):
                value = getattr(sub, name)
                if value is not None:
                    setattr(sub, name, value[:, :keep])
        assert sub.input_ids.shape[1] == prompt_width - first_real + sub.completion_length
        return sub


def left_aligned(rows: list[list], dtype: torch.dtype, fill: float, width: int | None = None) -> torch.Tensor:
    """(B, width) row r's values in its first len(rows[r]) places, ``fill`` after them (width: the longest row's,
    at least 1); one conversion of every value, not one per row."""
    lengths = torch.tensor([len(row) for row in rows])
    width = width if width is not None else max(int(lengths.max()), 1)
    grid = torch.full((len(rows), width), fill, dtype=dtype)
    grid[torch.arange(width) < lengths[:, None]] = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=dtype)
    return grid


def split_across_ranks(
    groups: list[torch.Tensor], lengths: torch.Tensor, world_size: int
) -> list[list[torch.Tensor | None]]:
    """Micro-batches (index tensors into ``lengths``) dealt to ``world_size`` ranks: at most ⌈n / world_size⌉
    each, the most tokens first to the rank with the fewest so far, so that ranks run their i-th micro-batches
    (which are collective for a sharded model) in step and on similar token counts. Every rank gets as many
    entries, None where it has no micro-batch left."""
    ranks: list[list[torch.Tensor | None]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    cap = -(-len(groups) // world_size)
    sizes = lengths.tolist()
    tokens = {id(group): sum(sizes[i] for i in group.tolist()) for group in groups}
    for group in sorted(groups, key=lambda g: -tokens[id(g)]):
        rank = min((r for r in range(world_size) if len(ranks[r]) < cap), key=lambda r: loads[r])
        ranks[rank].append(group)
        loads[rank] += tokens[id(group)]
    return [mine + [None] * (cap - len(mine)) for mine in ranks]


def last_sampled(completion_mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of each row's last sampled token (0 for a row without any)."""
    width = completion_mask.shape[1]
    return (width - 1 - completion_mask.flip(1).argmax(1)).clamp(min=0) * (completion_mask.sum(1) > 0)


def token_rewards(batch: LMBatch, kl: torch.Tensor | None, kl_coef: float) -> torch.Tensor:
    """(B, C) rewards: each turn's reward on that turn's last sampled token (single-turn: the sequence score
    on the last sampled token), minus β·KL_t on every sampled token if given."""
    mask = batch.completion_mask
    rewards = torch.zeros_like(mask)
    if batch.turn_rewards is None:
        rewards.scatter_(1, last_sampled(mask)[:, None], batch.scores[:, None].to(rewards.dtype))
        rewards = rewards * (mask.sum(1, keepdim=True) > 0)
    else:
        for turn in range(batch.turn_rewards.shape[1]):
            in_turn = (batch.token_turns == turn).to(mask.dtype)
            has_turn = in_turn.sum(1) > 0
            rows = has_turn.nonzero().flatten()
            rewards[rows, last_sampled(in_turn)[rows]] += batch.turn_rewards[rows, turn]
    if kl is not None:
        rewards = rewards - kl_coef * kl * mask
    return rewards


def episode_ends(completion_mask: torch.Tensor) -> torch.Tensor:
    """(B, C) dones: 1 on the last sampled token, where the episode ends."""
    dones = torch.zeros_like(completion_mask)
    return dones.scatter_(1, last_sampled(completion_mask)[:, None], 1.0)


def lm_advantages(
    batch: LMBatch, est: EstimatorConfig, *, group_size: int, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), (B, C), from the configured estimator over groups of ``group_size`` completions
    of one prompt; 0 on padding and inserted tokens."""
    mask = batch.completion_mask
    kl = None
    if est.kl_in_reward and batch.reference_logprobs is not None and kl_coef > 0:
        kl = kl_penalty(batch.behaviour_logprobs, batch.reference_logprobs, estimator=est.kl_estimator)
    rewards = token_rewards(batch, kl, kl_coef)
    family = advantage_family(est.advantage)
    if family == "group":
        heads, order, row_episode = episode_layout(batch, group_size)
        per_episode = torch.empty_like(rewards[heads, 0])  # (N,) in episode order
        scored = heads[order]  # the row that scores each episode, group after group
        data = {"scores": rewards.sum(1)[scored], "lengths": mask.sum(1)[scored], "group_size": group_size}
        if needs_greedy_baseline(est.advantage):
            data["greedy_scores"] = greedy_baseline_of(batch, est.advantage)[scored]
        per_episode[order] = ADVANTAGES.call(est.advantage, data, est)
        advantages = broadcast_to_tokens(per_episode[row_episode], mask)
        returns = broadcast_to_tokens(rewards.sum(1), mask)
    elif family == "turn":
        advantages = lm_turn_level_advantages(batch, rewards, est, group_size)
        returns = broadcast_to_tokens(rewards.sum(1), mask)
    else:  # step estimators see the sampled tokens as consecutive steps, inserted tokens removed
        packed_rewards, packed_mask = pack_masked(rewards, mask)
        values = pack_masked(batch.values * mask, mask)[0] if batch.values is not None else None
        data = {
            "rewards": packed_rewards,
            "values": values,
            "dones": episode_ends(packed_mask),
            "mask": packed_mask,
            "bootstrap_value": None,
        }  # the episode ends on the last sampled token: nothing to bootstrap
        if "group_index" in ADVANTAGES.entry(est.advantage).inputs:
            data.update(token_baseline_inputs(batch, group_size))
        advantages, returns = ADVANTAGES.call(est.advantage, data, est)
        advantages, returns = unpack_masked(advantages, mask), unpack_masked(returns, mask)
    if est.normalize_advantages:
        advantages = masked_whiten(advantages, mask) * mask
    return advantages, returns


def greedy_baseline_of(batch: LMBatch, advantage: str) -> torch.Tensor:
    """(B,) ``batch.greedy_scores``, which estimator ``advantage`` reads; a clear error when no greedy episode was run
    (the lm driver runs them, ``unipg.runtime.greedy_baseline``)."""
    if batch.greedy_scores is None:
        raise ValueError(
            f"advantage estimator '{advantage}' compares each completion with the greedy episode of its prompt, and "
            "this batch has none (LMBatch.greedy_scores); the lm driver generates them for every prompt it trains on"
        )
    return batch.greedy_scores.to(batch.scores.device)


def token_baseline_inputs(batch: LMBatch, group_size: int) -> dict[str, torch.Tensor]:
    """What a per-token group baseline (optimal_token_baseline) reads beside the step data: ``group_index`` (B,) the
    group of each row, and the rows' μ log-probs and Σπ² packed like the rewards (sampled tokens to the left)."""
    if batch.sum_pi_squared is None:
        raise ValueError("the per-token group baseline needs batch.sum_pi_squared; LMLearner.prepare computes it")
    mask = batch.completion_mask
    row_episode = episode_layout(batch, group_size)[2]
    return {
        "group_index": batch.groups if batch.groups is not None else row_episode // group_size,
        "behaviour_logprobs": pack_masked(batch.behaviour_logprobs, mask)[0],
        "sum_pi_squared": pack_masked(batch.sum_pi_squared, mask)[0],
    }


def turn_table(batch: LMBatch, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, K) rewards per policy turn (token rewards, KL included, summed within each turn) and turn mask;
    a single-turn batch is one turn per row."""
    if batch.token_turns is None:
        return rewards.sum(1, keepdim=True), (batch.completion_mask.sum(1, keepdim=True) > 0).float()
    turns = batch.turn_rewards.shape[1]
    per_turn = rewards.new_zeros((rewards.shape[0], turns))
    per_turn.scatter_add_(1, batch.token_turns.clamp(min=0), rewards * (batch.token_turns >= 0))
    return per_turn, batch.turn_mask


def episode_layout(batch: LMBatch, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """How the rows of ``batch`` form episodes and groups, for the group estimators: ``heads`` (N,) the first
    row of each of the N episodes (in batch order), the row that scores it; ``order`` (N,) the episodes group
    after group (within a group, in batch order), the layout the estimators read (``group_size`` consecutive
    episodes per group); ``row_episode`` (B,) each row's episode. Raises ``ValueError`` when a group does not
    hold ``group_size`` episodes."""
    rows = len(batch.scores)
    index = torch.arange(rows, device=batch.scores.device)
    if batch.episodes is None:
        return index, index, index
    _, row_episode = torch.unique(batch.episodes, return_inverse=True)  # episodes numbered 0..N-1
    count = int(row_episode.max()) + 1 if rows else 0
    heads = torch.full((count,), rows, dtype=torch.long, device=index.device).scatter_reduce(
        0, row_episode, index, reduce="amin"
    )
    if batch.groups is None:
        return heads, torch.arange(count, device=index.device), row_episode
    group_of_episode = batch.groups[heads]
    sizes = torch.unique(group_of_episode, return_counts=True)[1]
    if bool((sizes != group_size).any()):
        raise ValueError(
            f"a group holds {int(sizes[sizes != group_size][0])} episodes; a group-relative "
            f"advantage compares samples_per_prompt ({group_size}) episodes of one prompt"
        )
    return heads, torch.sort(group_of_episode, stable=True).indices, row_episode


def lm_turn_level_advantages(
    batch: LMBatch, rewards: torch.Tensor, est: EstimatorConfig, group_size: int
) -> torch.Tensor:
    """(B, C) advantages of a turn estimator (``turn_level``): per turn of each episode's first row, against the same turn of the
    other episodes of its group; the other rows of an episode (its side trajectories) get the episode's
    advantage at its first turn."""
    mask = batch.completion_mask
    heads, order, row_episode = episode_layout(batch, group_size)
    turn_rewards, turn_mask = turn_table(batch, rewards)
    scored = heads[order]
    per_turn = torch.empty_like(turn_rewards[heads])  # (N, K)
    per_turn[order] = ADVANTAGES.call(
        est.advantage,
        {"turn_rewards": turn_rewards[scored], "turn_mask": turn_mask[scored], "group_size": group_size},
        est,
    )
    per_turn = per_turn[row_episode]  # (B, K) the turns of each row's episode
    if batch.token_turns is None:
        return broadcast_to_tokens(per_turn[:, 0], mask)
    own = per_turn.gather(1, batch.token_turns.clamp(min=0))
    first_row = heads[row_episode] == torch.arange(len(row_episode), device=row_episode.device)
    return torch.where(first_row[:, None], own, per_turn[:, :1].expand_as(own)) * mask
