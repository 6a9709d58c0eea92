import pytest
import torch

from tests.helpers.batches import GROUP, make_batch, make_config
from unipg.learn.lm import LMLearner
from unipg.learn.lm_batch import LMBatch, episode_ends, lm_advantages, token_rewards


@pytest.fixture
def policy(tiny_policy):
    return tiny_policy(value_head=True, needs_reference=True)


def bare_batch(mask, scores, **fields):
    """A LMBatch with only the fields the reward layout reads."""
    mask = torch.as_tensor(mask, dtype=torch.float32)
    width = mask.shape[1]
    return LMBatch(
        input_ids=torch.zeros((len(mask), width + 1), dtype=torch.long),
        attention_mask=torch.ones((len(mask), width + 1), dtype=torch.long),
        completion_mask=mask,
        behaviour_logprobs=torch.zeros_like(mask),
        scores=torch.tensor(scores),
        **fields,
    )


def test_sequence_reward_sits_on_the_last_sampled_token():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    rewards = token_rewards(bare_batch(mask, [2.0, -1.0]), torch.full_like(mask, 0.5), kl_coef=0.1)
    assert torch.allclose(rewards, torch.tensor([[-0.05, -0.05, 1.95, 0.0], [-1.05, 0.0, 0.0, 0.0]]))
    assert torch.equal(episode_ends(mask), torch.tensor([[0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def two_turn_batch():
    """Two episodes; sampled tokens (mask 1) of turn 0, then inserted tool tokens (mask 0), then turn 1."""
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0], [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]])
    turns = torch.tensor([[0, 0, -1, -1, 1, 1], [0, -1, -1, 1, -1, -1]])
    turn_rewards = torch.tensor([[0.1, 1.0], [-0.1, 0.0]])
    return bare_batch(mask, [1.1, -0.1], token_turns=turns, turn_rewards=turn_rewards, turn_mask=torch.ones((2, 2)))


def test_turn_rewards_sit_on_the_last_sampled_token_of_each_turn():
    batch = two_turn_batch()
    rewards = token_rewards(batch, None, kl_coef=0.0)
    assert torch.allclose(rewards, torch.tensor([[0.0, 0.1, 0.0, 0.0, 0.0, 1.0], [-0.1, 0.0, 0.0, 0.0, 0.0, 0.0]]))
    # the episode ends on the last sampled token, not on the last inserted one
    assert torch.equal(episode_ends(batch.completion_mask)[1], torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 0.0]))


def test_turn_level_advantages_credit_each_turn_with_what_followed():
    config = make_config(
        "grpo",
        "sample.samples_per_prompt=2",
        "estimator.advantage=turn_level",
        "estimator.normalize_advantages=false",
        "estimator.gamma=1.0",
    )
    advantages, _ = lm_advantages(
        two_turn_batch(), config.estimator, group_size=config.sample.samples_per_prompt, kl_coef=0.0
    )
    # returns: episode 0 turns (1.1, 1.0), episode 1 turns (-0.1, 0.0); baseline = the other episode, same turn
    expected = torch.tensor([[1.2, 1.2, 0.0, 0.0, 1.0, 1.0], [-1.2, 0.0, 0.0, -1.0, 0.0, 0.0]])
    assert torch.allclose(advantages, expected, atol=1e-6)


def test_gae_skips_inserted_tokens():
    config = make_config(
        "ppo",
        "estimator.normalize_advantages=false",
        "estimator.gamma=0.5",
        "estimator.lambda_gae=1.0",
        "sample.samples_per_prompt=2",
    )
    batch = two_turn_batch()
    batch.values = torch.zeros_like(batch.completion_mask)
    advantages, _ = lm_advantages(batch, config.estimator, group_size=config.sample.samples_per_prompt, kl_coef=0.0)
    # episode 0's sampled tokens are 4 consecutive steps with rewards (0, 0.1, 0, 1.0) and γ = 0.5
    assert torch.allclose(advantages[0], torch.tensor([0.175, 0.35, 0.0, 0.0, 0.5, 1.0]), atol=1e-6)


def test_grpo_advantages_have_zero_mean_within_each_group(policy):
    batch = make_batch(policy)
    advantages, _ = lm_advantages(
        batch, make_config("grpo").estimator, group_size=make_config("grpo").sample.samples_per_prompt, kl_coef=0.0
    )
    per_sequence = advantages.sum(1) / batch.completion_mask.sum(1)
    assert torch.allclose(per_sequence.reshape(-1, GROUP).mean(1), torch.zeros(4), atol=1e-5)
    assert (advantages[batch.completion_mask == 0] == 0).all()


def test_ppo_token_gae_uses_the_critic(policy):
    config = make_config("ppo", "estimator.kl_coef=0.0", "estimator.lambda_gae=1.0")
    learner = LMLearner(policy, config)
    batch = make_batch(policy)
    learner.prepare(batch)
    mask = batch.completion_mask
    # γ = λ = 1: the return of every token is the sequence score; advantages are whitened over valid tokens
    assert torch.allclose(batch.returns[mask.bool()], batch.scores[:, None].expand_as(mask)[mask.bool()], atol=1e-5)
    assert abs(float(batch.advantages[mask.bool()].mean())) < 1e-5


def test_kl_to_reference_is_exactly_zero_before_the_first_update(policy):
    from unipg.estimate.kl import kl_penalty

    learner = LMLearner(policy, make_config("grpo", "estimator.kl_coef=0.1"))
    batch = make_batch(policy)
    learner.prepare(batch)
    same = batch.rows(torch.arange(len(batch.scores)))  # the rows exactly as the reference pass saw them
    with torch.no_grad():  # the same forward computation on the same weights
        current = policy.evaluate(same.input_ids, same.attention_mask, same.completion_length).logprobs
    kl = kl_penalty(current, same.reference_logprobs, estimator="k3") * same.completion_mask
    assert float(kl.abs().max()) < 1e-12  # zero up to the rounding of two model copies' kernels
    # the training forward (autograd on) may pick other attention kernels: equal up to float rounding
    assert learner.update(batch)["kl_to_reference"] < 1e-12


def surrogate(policy, batch, config):
    out = policy.evaluate(batch.input_ids, batch.attention_mask, batch.completion_length)
    mask = batch.completion_mask
    ratio = torch.exp(out.logprobs - batch.behaviour_logprobs)
    return float((ratio * batch.advantages * mask).sum() / mask.sum())


def test_one_update_changes_the_parameters_and_improves_the_surrogate(policy):
    config = make_config("grpo", "estimator.kl_coef=0.0", "train.learning_rate=3e-4")
    learner = LMLearner(policy, config)
    batch = make_batch(policy)
    learner.prepare(batch)
    before_params = [p.detach().clone() for p in policy.actor_parameters()]
    with torch.no_grad():
        before = surrogate(policy, batch, config)
    metrics = learner.update(batch)
    with torch.no_grad():
        after = surrogate(policy, batch, config)
    assert any(not torch.equal(b, p) for b, p in zip(before_params, policy.actor_parameters()))
    assert after > before
    assert metrics["grad_norm"] > 0 and 0.0 <= metrics["clip_fraction"] <= 1.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_accumulation_gives_the_full_batch_gradient(tiny_policy, mode):
    grads = []
    for micro in (16, 4):
        policy = tiny_policy()
        config = make_config(
            "grpo",
            "estimator.kl_coef=0.0",
            f"estimator.loss_agg_mode={mode}",
            f"train.micro_batch_size={micro}",
            "train.max_grad_norm=null",
        )
        learner = LMLearner(policy, config)
        batch = make_batch(policy)
        learner.prepare(batch)
        learner.optimizer.step = lambda: None  # keep the weights; only the accumulated gradient is compared
        learner.update(batch)
        grads.append(torch.cat([p.grad.flatten() for p in policy.actor_parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_rows_drop_only_all_padding_columns(policy):
    batch = make_batch(policy)
    batch.advantages = torch.randn_like(batch.completion_mask) * batch.completion_mask
    sub = batch.rows(torch.tensor([1, 2]))
    full = policy.evaluate(batch.input_ids[[1, 2]], batch.attention_mask[[1, 2]], batch.completion_length).logprobs
    trimmed = policy.evaluate(sub.input_ids, sub.attention_mask, sub.completion_length).logprobs
    width = sub.completion_length
    assert torch.allclose(full[:, :width] * sub.completion_mask, trimmed * sub.completion_mask, atol=1e-5)
    assert batch.completion_mask[[1, 2], width:].sum() == 0
