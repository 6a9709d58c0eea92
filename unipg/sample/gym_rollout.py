"""Rollouts from a vector of gymnasium environments, in the time-last layout of the estimator library.

Two details decide whether classic-control results match the published ones:

- **Time limits are not terminal states.** When an episode is cut by its time limit (truncated), the value
  of the state it was cut in is still worth having, so the reward of that step is increased by
  γ·V(s_final) and the step is marked done (Pardo et al. 2018, "Time limits in reinforcement learning").
  Estimators that bootstrap from the critic need this; Monte-Carlo estimators do not use it.
- **Monte-Carlo returns need complete episodes.** Without a critic to bootstrap from, the steps of an
  episode still running when the rollout ends have no return yet; they are masked out of the loss
  (``mask`` = 0) rather than given a truncated, biased return.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from unipg.policy.mlp import MLPActorCritic


@dataclass
class RolloutBatch:
    """One rollout of N environments for T steps; every tensor is (N, T, ...) with time second."""

    observations: torch.Tensor  # (N, T, obs_dim) s_t
    actions: torch.Tensor  # (N, T) or (N, T, A) a_t
    behaviour_logprobs: torch.Tensor  # (N, T) log μ(a_t|s_t), μ = the policy that acted
    values: torch.Tensor  # (N, T) V(s_t) at rollout time
    rewards: torch.Tensor  # (N, T) r_t (+ γ·V(s_final) on time-limit truncation when bootstrapping)
    dones: torch.Tensor  # (N, T) 1 when the episode ended at step t
    mask: torch.Tensor  # (N, T) 1 on steps that enter the loss
    bootstrap_value: torch.Tensor  # (N,) V(s_T), the state after the last step
    episode_returns: list[float] = field(default_factory=list)  # undiscounted returns of finished episodes
    episode_lengths: list[int] = field(default_factory=list)
    # What a learner needs to re-evaluate the critic's part of a stale segment (``with_values``):
    final_observations: torch.Tensor | None = None  # (N, obs_dim) s_T, whose value is ``bootstrap_value``
    truncated: torch.Tensor | None = None  # (N, T) 1 where a time limit cut the episode (and γ·V was added)
    truncation_observations: torch.Tensor | None = None  # (N, T, obs_dim) the state it was cut in, 0 elsewhere
    truncation_values: torch.Tensor | None = None  # (N, T) V(s_final) added (times γ) to those rewards, 0 elsewhere

    @property
    def num_steps(self) -> int:
        return self.rewards.numel()

    def with_values(self, value_fn: Callable[[torch.Tensor], torch.Tensor], gamma: float) -> RolloutBatch:
        """This segment with every critic value replaced by ``value_fn``'s: V(s_t), V(s_T) and the γ·V(s_final)
        added to rewards of time-limit cuts.

        A segment trained on some versions after it was collected keeps its actions and behaviour log-probs
        (they are what μ did), but advantages from a critic that has moved on since are better estimates
        than those of the critic that collected it.
        """
        n, t = self.rewards.shape
        with torch.no_grad():
            values = value_fn(self.observations.reshape(n * t, *self.observations.shape[2:])).reshape(n, t)
            bootstrap_value = self.bootstrap_value
            if self.final_observations is not None:
                bootstrap_value = value_fn(self.final_observations)
            rewards = self.rewards
            if self.truncated is not None and bool(self.truncated.any()):
                cut = self.truncated.bool()
                fresh = value_fn(self.truncation_observations[cut])
                rewards = rewards.clone()
                rewards[cut] += gamma * (fresh - self.truncation_values[cut])
        return replace(self, values=values, bootstrap_value=bootstrap_value, rewards=rewards)


def make_env(env_id: str, max_episode_steps: int | None = None) -> gym.Env:
    """gym.make with an error that suggests the nearest registered id."""
    try:
        return gym.make(env_id, max_episode_steps=max_episode_steps)
    except gym.error.Error as error:
        close = difflib.get_close_matches(env_id, list(gym.registry), n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"cannot make gymnasium environment '{env_id}': {error}.{hint}") from None


def make_vector_env(env_id: str, num_envs: int, max_episode_steps: int | None = None) -> SyncVectorEnv:
    make_env(env_id, max_episode_steps).close()  # fail early, with the helpful message
    return SyncVectorEnv(
        [lambda: make_env(env_id, max_episode_steps) for _ in range(num_envs)],
        autoreset_mode=AutoresetMode.SAME_STEP,
    )


class RewardScaler:
    """Divides rewards by a running std of the discounted return (the 'reward normalisation' of PPO codes)."""

    def __init__(self, num_envs: int, gamma: float, epsilon: float = 1e-8):
        self.gamma, self.epsilon = gamma, epsilon
        self.discounted = np.zeros(num_envs)
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def __call__(self, rewards: np.ndarray, dones: np.ndarray) -> np.ndarray:
        self.discounted = self.discounted * self.gamma + rewards
        for value in self.discounted:  # Welford's online variance
            self.count += 1
            delta = value - self.mean
            self.mean += delta / self.count
            self.m2 += delta * (value - self.mean)
        self.discounted[dones] = 0.0
        variance = self.m2 / self.count if self.count > 1 else 1.0
        return rewards / np.sqrt(variance + self.epsilon)

    def state_dict(self) -> dict:
        return {"discounted": self.discounted.tolist(), "count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.discounted = np.asarray(state["discounted"], dtype=float)
        self.count, self.mean, self.m2 = state["count"], state["mean"], state["m2"]


class GymRollout:
    """Steps a vector of environments with the current policy and returns RolloutBatch-es."""

    def __init__(
        self,
        env_id: str,
        num_envs: int,
        *,
        seed: int,
        gamma: float,
        max_episode_steps: int | None = None,
        normalize_rewards: bool = False,
    ):
        self.envs = make_vector_env(env_id, num_envs, max_episode_steps)
        self.num_envs, self.gamma = num_envs, gamma
        self.reward_scaler = RewardScaler(num_envs, gamma) if normalize_rewards else None
        observations, _ = self.envs.reset(seed=seed)
        self.envs.action_space.seed(seed)
        self.observations = torch.as_tensor(observations, dtype=torch.float32)
        self.running_returns = np.zeros(num_envs)
        self.running_lengths = np.zeros(num_envs, dtype=int)

    @property
    def observation_space(self) -> gym.Space:
        return self.envs.single_observation_space

    @property
    def action_space(self) -> gym.Space:
        return self.envs.single_action_space

    def collect(self, policy: MLPActorCritic, steps_per_env: int, *, bootstrap: bool) -> RolloutBatch:
        """Run every environment for ``steps_per_env`` steps with ``policy``.

        ``bootstrap``: the advantage estimator uses the critic (time limits are bootstrapped); otherwise
        steps of unfinished episodes are masked out.
        """
        observations, actions, logprobs, values, rewards, dones = [], [], [], [], [], []
        cuts, cut_observations, cut_values = [], [], []
        episode_returns, episode_lengths = [], []
        for _ in range(steps_per_env):
            sample = policy.act(self.observations)
            next_obs, reward, terminated, truncated, info = self.envs.step(self._env_actions(sample.actions))
            done = terminated | truncated
            self.running_returns += reward
            self.running_lengths += 1
            episode_returns += self.running_returns[done].tolist()
            episode_lengths += self.running_lengths[done].tolist()
            self.running_returns[done], self.running_lengths[done] = 0.0, 0
            reward = reward.astype(np.float64)
            if self.reward_scaler is not None:
                reward = self.reward_scaler(reward, done)
            if bootstrap:
                cut, final_obs, final_values = self._truncation_bootstrap(policy, terminated, truncated, info)
                reward = reward + self.gamma * final_values.numpy()  # float32 product, as γ·V always was
                cuts.append(torch.as_tensor(cut, dtype=torch.float32))
                cut_observations.append(final_obs)
                cut_values.append(final_values)
            observations.append(self.observations)
            actions.append(sample.actions)
            logprobs.append(sample.logprobs)
            values.append(sample.values)
            rewards.append(torch.as_tensor(reward, dtype=torch.float32))
            dones.append(torch.as_tensor(done, dtype=torch.float32))
            self.observations = torch.as_tensor(next_obs, dtype=torch.float32)
        with torch.no_grad():
            bootstrap_value = policy.value(self.observations) if bootstrap else torch.zeros(self.num_envs)
        done_steps = torch.stack(dones, dim=1)  # (N, T)
        mask = torch.ones_like(done_steps) if bootstrap else complete_episode_mask(done_steps)
        critic_inputs = {}  # for re-evaluating the critic's values later (RolloutBatch.with_values)
        if bootstrap:
            critic_inputs = {
                "final_observations": self.observations,
                "truncated": torch.stack(cuts, dim=1),
                "truncation_observations": torch.stack(cut_observations, dim=1),
                "truncation_values": torch.stack(cut_values, dim=1),
            }
        return RolloutBatch(
            torch.stack(observations, dim=1),
            torch.stack(actions, dim=1),
            torch.stack(logprobs, dim=1),
            torch.stack(values, dim=1),
            torch.stack(rewards, dim=1),
            done_steps,
            mask,
            bootstrap_value,
            episode_returns,
            episode_lengths,
            **critic_inputs,
        )

    def _env_actions(self, actions: torch.Tensor) -> np.ndarray:
        """Actions as the environments take them: Gaussian samples are clipped to the action bounds."""
        actions = actions.cpu().numpy()
        if isinstance(self.action_space, gym.spaces.Box):
            return np.clip(actions, self.action_space.low, self.action_space.high)
        return actions

    def _truncation_bootstrap(self, policy, terminated, truncated, info):
        """(cut (N,) bool, final observations (N, obs_dim), V(s_final) (N,)) for the episodes a time limit cut
        at this step; observations and values are 0 for the others."""
        cut = truncated & ~terminated
        final_obs = torch.zeros_like(self.observations)
        final_values = torch.zeros(self.num_envs)
        if cut.any():
            index = torch.as_tensor(np.flatnonzero(cut))
            final_obs[index] = torch.as_tensor(
                np.stack([info["final_obs"][i] for i in index.tolist()]), dtype=torch.float32
            )
            with torch.no_grad():
                final_values[index] = policy.value(final_obs[index])
        return cut, final_obs, final_values

    def state_dict(self) -> dict:
        """JSON-ready state of the rollout between two segments: the environments (``env_state``), the latest
        observations, the running returns and lengths of unfinished episodes, and the reward scaler."""
        return {
            "envs": [env_state(env) for env in self.envs.envs],
            "vector": plain_attributes(self.envs),
            "observations": self.observations.tolist(),
            "running_returns": self.running_returns.tolist(),
            "running_lengths": self.running_lengths.tolist(),
            "reward_scaler": self.reward_scaler.state_dict() if self.reward_scaler is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a ``state_dict``, in a rollout made with the same environment id and count."""
        if len(state["envs"]) != self.num_envs:
            raise ValueError(f"the state holds {len(state['envs'])} environments, this rollout has {self.num_envs}")
        for env, saved in zip(self.envs.envs, state["envs"]):
            load_env_state(env, saved)
        load_plain_attributes(self.envs, state["vector"])
        self.observations = torch.tensor(state["observations"], dtype=torch.float32)
        self.running_returns = np.asarray(state["running_returns"], dtype=float)
        self.running_lengths = np.asarray(state["running_lengths"], dtype=int)
        if (state["reward_scaler"] is None) != (self.reward_scaler is None):
            raise ValueError("estimator.normalize_rewards changed since the state was saved")
        if self.reward_scaler is not None:
            self.reward_scaler.load_state_dict(state["reward_scaler"])

    def close(self) -> None:
        self.envs.close()


# --- environment state as JSON ---------------------------------------------------------------------------
# An environment whose dynamics live in plain attributes (numbers, NumPy arrays, its ``np_random``), as in
# gymnasium's classic-control ones, is restored exactly; state held elsewhere (a MuJoCo simulator, a Box2D
# world) is not captured, and such an environment continues from where a fresh reset put it.


def _encode(value):
    """A JSON-ready form of ``value``, or None when it is not plain data (spaces, callables, simulators)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"v": value}
    if isinstance(value, np.generic):
        return {"v": value.item(), "scalar": value.dtype.str}
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        return {"v": value.tolist(), "array": value.dtype.str, "shape": list(value.shape)}
    if isinstance(value, np.random.Generator):
        return {"v": value.bit_generator.state, "generator": True}
    if isinstance(value, tuple) and all(isinstance(item, (int, float)) for item in value):
        return {"v": list(value), "tuple": True}
    return None


def _decode(encoded: dict, current):
    value = encoded["v"]
    if "scalar" in encoded:
        return np.dtype(encoded["scalar"]).type(value)
    if "array" in encoded:
        return np.asarray(value, dtype=np.dtype(encoded["array"])).reshape(encoded["shape"])
    if "generator" in encoded:
        generator = current if isinstance(current, np.random.Generator) else np.random.default_rng()
        generator.bit_generator.state = value
        return generator
    if "tuple" in encoded:
        return tuple(value)
    return value


def plain_attributes(obj) -> dict:
    """The attributes of ``obj`` that are plain data, encoded for JSON."""
    encoded = {name: _encode(value) for name, value in vars(obj).items()}
    return {name: value for name, value in encoded.items() if value is not None}


def load_plain_attributes(obj, state: dict) -> None:
    for name, encoded in state.items():
        setattr(obj, name, _decode(encoded, getattr(obj, name, None)))


def env_state(env: gym.Env) -> list[dict]:
    """The plain attributes of ``env`` and of every environment it wraps, outermost first."""
    layers = [plain_attributes(env)]
    while isinstance(env, gym.Wrapper):
        env = env.env
        layers.append(plain_attributes(env))
    return layers


def load_env_state(env: gym.Env, layers: list[dict]) -> None:
    for layer in layers:
        load_plain_attributes(env, layer)
        env = env.env if isinstance(env, gym.Wrapper) else None
    if env is not None:
        raise ValueError("the saved environment has fewer wrapper layers than this one")


def complete_episode_mask(dones: torch.Tensor) -> torch.Tensor:
    """(N, T) mask that is 1 up to and including each row's last done, 0 after it."""
    steps = torch.arange(dones.shape[1])
    last_done = torch.where(dones.bool(), steps, torch.full_like(steps, -1)).amax(dim=1)  # (N,)
    return (steps.unsqueeze(0) <= last_done.unsqueeze(1)).float()


def evaluate_policy(
    policy: MLPActorCritic,
    env_id: str,
    *,
    episodes: int,
    seed: int,
    deterministic: bool = True,
    max_episode_steps: int | None = None,
) -> list[float]:
    """Undiscounted returns of ``episodes`` fresh episodes, one per environment, run side by side."""
    envs = SyncVectorEnv(
        [lambda: make_env(env_id, max_episode_steps) for _ in range(episodes)], autoreset_mode=AutoresetMode.SAME_STEP
    )
    observations, _ = envs.reset(seed=seed)
    returns = np.zeros(episodes)
    running = np.ones(episodes, dtype=bool)
    while running.any():
        sample = policy.act(torch.as_tensor(observations, dtype=torch.float32), deterministic=deterministic)
        actions = sample.actions.cpu().numpy()
        if isinstance(envs.single_action_space, gym.spaces.Box):
            actions = np.clip(actions, envs.single_action_space.low, envs.single_action_space.high)
        observations, rewards, terminated, truncated, _ = envs.step(actions)
        returns += rewards * running
        running &= ~(terminated | truncated)
    envs.close()
    return returns.tolist()
