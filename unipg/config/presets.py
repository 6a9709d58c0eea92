"""Named algorithm presets: an algorithm is one answer to each of the three questions.

A preset fills the defaults a user did not set; every value can be overridden. Each preset also says which
config keys the algorithm ignores beyond those its mode never reads (declared on the fields), so that setting
one of those is reported instead of silently doing nothing; estimator hyperparameters that only some estimators
read are not listed here but derived from the estimator registries (``unipg.config.hyperparameters``). The
classic-control defaults follow the tuned settings practitioners publish for CartPole-v1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from unipg.config.hyperparameters import unread_hyperparameters
from unipg.config.modes import unread_keys
from unipg.config.policy_loss_presets import POLICY_LOSS_PRESETS

# Keys that one mode never reads, declared on the fields (``read_in`` in ``unipg.config.section``): a gymnasium
# run has no language model, task, agent or reference model, and its one-step samples give every loss aggregation
# mode the same result; a language-model run has no gymnasium environment, MLP or gym batch sizes.
_GYM_UNUSED = unread_keys("gym")
_LM_UNUSED = unread_keys("lm")
# The critic regression epochs of TRPO's separate critic optimizer: a train key, so no estimator registry
# declares it. (Estimator hyperparameters that only some estimators read, such as TRPO's max_kl or PPO's
# clip_range, are not listed here: ``unipg.config.hyperparameters`` derives them from the registries.)
_TRPO_TRAIN = frozenset({"train.critic_updates"})


@dataclass(frozen=True)
class Algorithm:
    name: str
    summary: str
    preset: dict[str, Any] | None  # defaults on gymnasium environments; None: text tasks only
    unused: frozenset[str] = field(default_factory=frozenset)
    lm_preset: dict[str, Any] | None = None  # defaults on text tasks; None: gymnasium environments only
    lm_unused: frozenset[str] = field(default_factory=frozenset)

    def preset_for(self, text: bool) -> dict[str, Any]:
        preset = self.lm_preset if text else self.preset
        if preset is None:
            if text:
                raise ValueError(
                    f"algorithm '{self.name}' trains MLP policies on gymnasium environments, not "
                    f"language models; pick one of: {', '.join(lm_algorithm_names())}"
                )
            raise ValueError(
                f"algorithm '{self.name}' trains language models on text tasks; set task.name "
                "(e.g. task.name=arithmetic) or pick one of: " + ", ".join(gym_algorithm_names())
            )
        return preset

    def uses(self, dotted_key: str, text: bool = False) -> bool:
        unused = (self.lm_unused | _LM_UNUSED) if text else (self.unused | _GYM_UNUSED)
        section = dotted_key.split(".", 1)[0] + ".*"
        return dotted_key not in unused and section not in unused


ALGORITHMS: dict[str, Algorithm] = {}


def _define(
    name: str,
    summary: str,
    preset: dict[str, Any] | None,
    unused: frozenset[str] = frozenset(),
    lm_preset: dict[str, Any] | None = None,
    lm_unused: frozenset[str] = frozenset(),
) -> None:
    if name in ALGORITHMS:
        raise ValueError(f"algorithm '{name}' is defined twice")
    ALGORITHMS[name] = Algorithm(name, summary, preset, unused, lm_preset, lm_unused)


def algorithm_names() -> list[str]:
    return sorted(ALGORITHMS)


def gym_algorithm_names() -> list[str]:
    return sorted(name for name, algorithm in ALGORITHMS.items() if algorithm.preset is not None)


def lm_algorithm_names() -> list[str]:
    return sorted(name for name, algorithm in ALGORITHMS.items() if algorithm.lm_preset is not None)


def _lm_preset(
    estimator: dict[str, Any], train: dict[str, Any] | None = None, **sections: dict[str, Any]
) -> dict[str, Any]:
    """A text-task preset: shared language-model defaults plus the algorithm's own choices."""
    preset = {
        "estimator": {
            "gamma": 1.0,
            "lambda_gae": 0.95,
            "normalize_advantages": False,
            "entropy_coef": 0.0,
            "kl_estimator": "k3",
            **estimator,
        },
        "train": {
            "learning_rate": 1e-6,
            "lr_schedule": "constant",
            "batch_size": 64,
            "mini_batch_size": 64,
            "num_epochs": 1,
            "max_grad_norm": 1.0,
            "adam_eps": 1e-8,
            **(train or {}),
        },
        "sample": {"samples_per_prompt": 8, "max_new_tokens": 256, "temperature": 1.0},
    }
    for name, values in sections.items():
        preset.setdefault(name, {}).update(values)
    return preset


# Keys without effect when the advantage comes from a group of completions and no critic is trained.
_CRITIC_FREE = frozenset(
    {
        "estimator.value_loss_coef",
        "estimator.value_clip_range",
        "train.critic_learning_rate",
        "model.value_head",
        "model.critic",
    }
)

_define(
    "ppo",
    "PPO-clip with a critic and GAE, epochs of shuffled mini-batches (Schulman et al. 2017)",
    {
        "env": {"num_envs": 8},
        "estimator": {
            "advantage": "gae",
            "policy_loss": "ppo",
            "gamma": 0.98,
            "lambda_gae": 0.8,
            "clip_range": 0.2,
            "entropy_coef": 0.0,
            "value_loss_coef": 0.5,
        },
        "train": {
            "learning_rate": 1e-3,
            "lr_schedule": "linear",
            "batch_transitions": 256,
            "mini_batch_transitions": 64,
            "num_epochs": 10,
            "max_grad_norm": 0.5,
        },
    },
    _TRPO_TRAIN,
    # RLHF-style PPO (Ziegler et al. 2019; Ouyang et al. 2022): value head, token-level GAE with γ = 1,
    # the KL to the reference folded into each token's reward.
    _lm_preset(
        {
            "advantage": "gae",
            "policy_loss": "ppo",
            "clip_range": 0.2,
            "normalize_advantages": True,
            "kl_coef": 0.05,
            "kl_in_reward": True,
            "kl_estimator": "k1",  # the reward's penalty is β·log(π/π_ref) in Ziegler et al. and Ouyang et al.
            "value_loss_coef": 0.5,
            "value_clip_range": 0.2,
            "loss_agg_mode": "token-mean",
        },
        {"num_epochs": 2, "mini_batch_size": 32},
        model={"value_head": True},
    ),
)
_define(
    "trpo",
    "TRPO: natural-gradient step in a KL trust region, conjugate gradient and line search (Schulman et al. 2015)",
    {
        "env": {"num_envs": 4},
        "estimator": {
            "advantage": "gae",
            "policy_loss": "trpo",
            "gamma": 0.99,
            "lambda_gae": 0.95,
            "max_kl": 0.01,
            "cg_iterations": 10,
            "cg_damping": 0.1,
        },
        "train": {
            "learning_rate": 1e-3,
            "batch_transitions": 1024,
            "mini_batch_transitions": 128,
            "critic_updates": 10,
            "max_grad_norm": None,
        },
    },
    frozenset(
        {
            "estimator.value_loss_coef",
            "estimator.value_clip_range",
            "train.num_epochs",
            "estimator.entropy_coef",
            "estimator.off_policy_weight",
        }
    ),
)
_define(
    "a2c",
    "advantage actor-critic: n-step returns bootstrapped by the critic, one gradient step per rollout (Mnih et al. 2016)",
    {
        "env": {"num_envs": 8},
        "estimator": {
            "advantage": "gae",
            "policy_loss": "vanilla",
            "gamma": 0.99,
            "lambda_gae": 1.0,
            "normalize_advantages": False,
            "entropy_coef": 0.0,
            "value_loss_coef": 0.5,
        },
        "train": {
            "learning_rate": 7e-4,
            "batch_transitions": 40,
            "mini_batch_transitions": 40,
            "num_epochs": 1,
            "max_grad_norm": 0.5,
        },
    },
    _TRPO_TRAIN | {"estimator.value_clip_range"},
)
_define(
    "reinforce",
    "REINFORCE with reward-to-go and a learned value baseline (Williams 1992)",
    {
        "env": {"num_envs": 8},
        "estimator": {
            "advantage": "value_baseline",
            "policy_loss": "vanilla",
            "gamma": 0.99,
            "normalize_advantages": True,
            "entropy_coef": 0.0,
            "value_loss_coef": 0.5,
        },
        "train": {
            "learning_rate": 1e-3,
            "batch_transitions": 4000,
            "mini_batch_transitions": 4000,
            "num_epochs": 1,
            "max_grad_norm": 0.5,
        },
    },
    _TRPO_TRAIN | {"estimator.value_clip_range"},
    # On text: the sequence reward on every token minus the batch mean, no critic.
    _lm_preset({"advantage": "batch_mean_baseline", "policy_loss": "vanilla", "kl_coef": 0.0}),
    _CRITIC_FREE,
)
_define(
    "grpo",
    "GRPO: group-normalised advantages over samples_per_prompt completions, PPO-clip, k3 KL to the "
    "reference as a loss term, no critic (Shao et al. 2024)",
    None,
    frozenset(),
    _lm_preset(
        {
            "advantage": "grpo",
            "policy_loss": "ppo",
            "clip_range": 0.2,
            "kl_coef": 0.04,
            "loss_agg_mode": "seq-mean-token-mean",
        }
    ),
    _CRITIC_FREE,
)
_define(
    "dr_grpo",
    "Dr.GRPO: GRPO without the std division and with a constant token-sum normaliser (Liu et al. 2025)",
    None,
    frozenset(),
    _lm_preset(
        {
            "advantage": "dr_grpo",
            "policy_loss": "ppo",
            "clip_range": 0.2,
            "kl_coef": 0.0,
            "loss_agg_mode": "seq-mean-token-sum-norm",
        }
    ),
    _CRITIC_FREE,
)
_define(
    "dapo",
    "DAPO-style GRPO: token-level loss, asymmetric clip-higher (ε_low 0.2, ε_high 0.28), no KL, dynamic sampling "
    "(groups that scored alike replaced by other prompts) (Yu et al. 2025)",
    None,
    frozenset(),
    _lm_preset(
        {
            "advantage": "grpo",
            "policy_loss": "ppo",
            "clip_range": 0.2,
            "clip_range_high": 0.28,
            "kl_coef": 0.0,
            "loss_agg_mode": "token-mean",
        },
        sample={"dynamic_sampling": True},
    ),
    _CRITIC_FREE,
)
_define(
    "rloo",
    "RLOO: leave-one-out baseline over samples_per_prompt completions, no critic (Ahmadian et al. 2024)",
    None,
    frozenset(),
    _lm_preset(
        {
            "advantage": "rloo",
            "policy_loss": "ppo",
            "clip_range": 0.2,
            "kl_coef": 0.05,
            "kl_in_reward": True,
            "kl_estimator": "k1",  # the RLOO paper's (and TRL's) reward: r − β·log(π/π_ref)
            "loss_agg_mode": "seq-mean-token-mean",
        }
    ),
    _CRITIC_FREE,
)
_define(
    "reinforce_pp",
    "REINFORCE++: token-level reward-to-go with the KL in the reward, whitened over the batch, PPO-clip, no "
    "critic (Hu 2025)",
    None,
    frozenset(),
    _lm_preset(
        {
            "advantage": "reinforce_plus_plus",
            "policy_loss": "ppo",
            "clip_range": 0.2,
            "kl_coef": 0.01,
            "kl_in_reward": True,
            "kl_estimator": "k1",  # REINFORCE++ puts β·log(π/π_ref) in each token's reward
            "loss_agg_mode": "token-mean",
        }
    ),
    _CRITIC_FREE,
)
_define(
    "remax",
    "ReMax: REINFORCE with the reward of the greedy response to the same prompt as baseline (one extra greedy "
    "episode per prompt, not trained on), one completion per prompt, no ratio, clip, critic or KL (Li et al. 2023)",
    None,
    frozenset(),
    _lm_preset(
        {"advantage": "remax", "policy_loss": "vanilla", "kl_coef": 0.0, "loss_agg_mode": "token-mean"},
        sample={"samples_per_prompt": 1},
    ),
    _CRITIC_FREE,
)

for _name, (_summary, _estimator, _train) in POLICY_LOSS_PRESETS.items():
    _define(
        _name,
        _summary,
        None,
        frozenset(),
        _lm_preset({"advantage": "grpo", "kl_coef": 0.0, **_estimator}, _train),
        _CRITIC_FREE,
    )


def ignored_keys(config, user_keys: set[str]) -> list[str]:
    """A warning for each key the user set that this configuration never reads: keys the algorithm does not use
    (the lists above), and estimator hyperparameters that no chosen estimator declares (from the registries)."""
    algorithm = ALGORITHMS[config.algorithm]
    text = config.is_lm
    where = "on a text task" if text else "on a gymnasium environment"
    unread = unread_hyperparameters(config.estimator, user_keys)
    warnings = []
    for key in sorted(user_keys):
        if key == "task.name":
            continue
        if not algorithm.uses(key, text):
            warnings.append(f"'{key}' has no effect with algorithm '{config.algorithm}' {where}; remove it")
        elif key in unread:
            warnings.append(unread[key])
    if "train.tis_cap" in user_keys and text and config.engine_tis_cap is None:
        warnings.append(
            "'train.tis_cap' has no effect while the engine gap is not corrected (train.tis is off, or auto "
            "with the hf engine); set train.tis=on"
        )
    if config.estimator.off_policy_weight in {"age_decay", "version_window"}:
        warnings.append(
            f"estimator.off_policy_weight '{config.estimator.off_policy_weight}' has no effect in "
            "synchronous training: every sample comes from the current policy (age 0)"
        )
    return warnings
