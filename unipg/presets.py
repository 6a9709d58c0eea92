"""Named algorithm presets: an algorithm is one answer to each of the three questions.

A preset fills the defaults a user did not set; every value can be overridden. Each preset also says which
config keys the algorithm ignores, so that setting one of those is reported instead of silently doing
nothing. The classic-control defaults follow the tuned settings practitioners publish for CartPole-v1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Keys synchronous classic-control training never reads: no reference model, no replay buffer, MLPs on the
# CPU, and one-step samples for which every loss aggregation mode gives the same result.
_GYM_UNUSED = frozenset(
    {
        "device",
        "estimator.loss_agg_mode",
        "estimator.kl_coef",
        "estimator.kl_estimator",
        "estimator.kl_control",
        "estimator.target_kl",
        "estimator.kl_horizon",
        "sample.rollout_steps",
        "sample.replay_buffer_size",
    }
)
_TRPO_ONLY = frozenset(
    {
        "estimator.max_kl",
        "estimator.cg_iterations",
        "estimator.cg_damping",
        "estimator.line_search_steps",
        "estimator.backtrack_coef",
        "train.critic_updates",
    }
)
_CLIP_ONLY = frozenset({"estimator.clip_range", "estimator.clip_range_high", "estimator.dual_clip"})


@dataclass(frozen=True)
class Algorithm:
    name: str
    summary: str
    preset: dict[str, Any]
    unused: frozenset[str] = field(default_factory=frozenset)

    def uses(self, dotted_key: str) -> bool:
        return dotted_key not in self.unused


ALGORITHMS: dict[str, Algorithm] = {}


def _define(name: str, summary: str, preset: dict[str, Any], unused: frozenset[str]) -> None:
    if name in ALGORITHMS:
        raise ValueError(f"algorithm '{name}' is defined twice")
    ALGORITHMS[name] = Algorithm(name, summary, preset, unused)


def algorithm_names() -> list[str]:
    return sorted(ALGORITHMS)


_define(
    "ppo",
    "PPO-clip with a critic and GAE, epochs of shuffled mini-batches (Schulman et al. 2017)",
    {
        "env": {"num_envs": 8},
        "estimator": {"advantage": "gae", "policy_loss": "ppo", "gamma": 0.98, "lambda_gae": 0.8,
                      "clip_range": 0.2, "entropy_coef": 0.0, "value_loss_coef": 0.5},
        "train": {"learning_rate": 1e-3, "lr_schedule": "linear", "batch_size": 256, "mini_batch_size": 64,
                  "num_epochs": 10, "max_grad_norm": 0.5},
    },
    _GYM_UNUSED | _TRPO_ONLY,
)
_define(
    "trpo",
    "TRPO: natural-gradient step in a KL trust region, conjugate gradient and line search (Schulman et al. 2015)",
    {
        "env": {"num_envs": 4},
        "estimator": {"advantage": "gae", "policy_loss": "trpo", "gamma": 0.99, "lambda_gae": 0.95,
                      "max_kl": 0.01, "cg_iterations": 10, "cg_damping": 0.1},
        "train": {"learning_rate": 1e-3, "batch_size": 1024, "mini_batch_size": 128, "critic_updates": 10,
                  "max_grad_norm": None},
    },
    _GYM_UNUSED | _CLIP_ONLY | {"estimator.value_loss_coef", "estimator.value_clip_range", "train.num_epochs",
                                "estimator.entropy_coef", "estimator.off_policy_weight"},
)
_define(
    "a2c",
    "advantage actor-critic: n-step returns bootstrapped by the critic, one gradient step per rollout (Mnih et al. 2016)",
    {
        "env": {"num_envs": 8},
        "estimator": {"advantage": "gae", "policy_loss": "vanilla", "gamma": 0.99, "lambda_gae": 1.0,
                      "normalize_advantages": False, "entropy_coef": 0.0, "value_loss_coef": 0.5},
        "train": {"learning_rate": 7e-4, "batch_size": 40, "mini_batch_size": 40, "num_epochs": 1,
                  "max_grad_norm": 0.5},
    },
    _GYM_UNUSED | _TRPO_ONLY | _CLIP_ONLY | {"estimator.value_clip_range"},
)
_define(
    "reinforce",
    "REINFORCE with reward-to-go and a learned value baseline (Williams 1992)",
    {
        "env": {"num_envs": 8},
        "estimator": {"advantage": "value_baseline", "policy_loss": "vanilla", "gamma": 0.99,
                      "normalize_advantages": True, "entropy_coef": 0.0, "value_loss_coef": 0.5},
        "train": {"learning_rate": 1e-3, "batch_size": 4000, "mini_batch_size": 4000, "num_epochs": 1,
                  "max_grad_norm": 0.5},
    },
    _GYM_UNUSED | _TRPO_ONLY | _CLIP_ONLY | {"estimator.lambda_gae", "estimator.value_clip_range"},
)


# Hyperparameters that only matter for one choice of another key: key → (governing key, value it needs).
_CONDITIONAL = {
    "estimator.lambda_gae": ("estimator.advantage", {"gae"}),
    "estimator.is_truncation": ("estimator.off_policy_weight", {"truncated_is"}),
    "estimator.kl_filter_threshold": ("estimator.off_policy_weight", {"kl_filter"}),
    "estimator.kl_filter_mode": ("estimator.off_policy_weight", {"kl_filter"}),
    "estimator.version_window": ("estimator.off_policy_weight", {"version_window"}),
    "estimator.sample_age_decay": ("estimator.off_policy_weight", {"age_decay"}),
    "estimator.clip_range": ("estimator.policy_loss", {"ppo", "decoupled_ppo"}),
    "estimator.clip_range_high": ("estimator.policy_loss", {"ppo", "decoupled_ppo"}),
    "estimator.dual_clip": ("estimator.policy_loss", {"ppo", "decoupled_ppo"}),
}


def ignored_keys(config, user_keys: set[str]) -> list[str]:
    """A warning for each key the user set that this configuration never reads."""
    algorithm = ALGORITHMS[config.algorithm]
    warnings = []
    for key in sorted(user_keys):
        if not algorithm.uses(key):
            warnings.append(f"'{key}' has no effect with algorithm '{config.algorithm}' on a gymnasium "
                            "environment; remove it")
        elif key in _CONDITIONAL:
            governing, needed = _CONDITIONAL[key]
            section, name = governing.split(".")
            if getattr(getattr(config, section), name) not in needed:
                options = " or ".join(sorted(needed))
                warnings.append(f"'{key}' has no effect unless {governing} is {options}; remove it or set {governing}")
    if config.estimator.off_policy_weight in {"age_decay", "version_window"}:
        warnings.append(f"estimator.off_policy_weight '{config.estimator.off_policy_weight}' has no effect in "
                        "synchronous training: every sample comes from the current policy (age 0)")
    return warnings
