"""unipg: policy-gradient reinforcement learning, from CartPole to tool-using language-model agents.

    import unipg
    result = unipg.train("configs/cartpole_ppo.yaml", train__updates=2)
    print(result.run_dir, result.metrics)

``train`` runs a configuration (a YAML path or a ``Config``) with keyword overrides; ``evaluate`` gives the
held-out metrics of a finished language-model run; ``load_config`` validates a configuration without running it.

The extension surface is public and stable: the registries (``TASKS``, ``REWARDS``, ``TOOLS``, ``TOOL_PARSERS``,
``ENVS``, ``ENGINES``, ``ADVANTAGES``, ``POLICY_LOSSES``, ``OFF_POLICY_WEIGHTS``, ``KL_ESTIMATORS``, ``BACKENDS``,
``CHECKS``) and the types a plugin builds (``Task``, ``Example``, ``tool``, ``ToolError``, ``StepResult``, ``Env``,
``Engine``, ``Rollout`` ...) are importable from here and from ``unipg.tasks``, ``unipg.tools``, ``unipg.envs``,
``unipg.inference``, ``unipg.estimate`` and ``unipg.runtime``. Deeper module paths are internal and may move.
"""

from unipg import _moved
from unipg._compat import companions_to_hide as companions_to_hide  # re-exported for tests and tools
from unipg._compat import hide_mismatched_torch_companions

HIDDEN_PACKAGES = hide_mismatched_torch_companions()  # before anything imports transformers
_moved.install()

from unipg.api import RunResult, evaluate, load_config, train  # noqa: E402
from unipg.config import Config, ConfigError  # noqa: E402

# public name → the module that defines it, imported on first use (``import unipg`` stays light)
_PUBLIC = {
    **dict.fromkeys(
        ["TASKS", "REWARDS", "Task", "Example", "make_task", "build_rewards", "RewardFunctionError"], "unipg.tasks"
    ),
    **dict.fromkeys(["TOOLS", "TOOL_PARSERS", "tool", "Tool", "ToolError", "LatencyModel"], "unipg.tools"),
    **dict.fromkeys(["ENVS", "Env", "RoleEnv", "StepResult", "TurnInfo", "EnvironmentService"], "unipg.envs"),
    **dict.fromkeys(["ENGINES", "Engine", "SamplingParams", "TurnOutput"], "unipg.inference"),
    **dict.fromkeys(["ADVANTAGES", "POLICY_LOSSES", "OFF_POLICY_WEIGHTS", "KL_ESTIMATORS"], "unipg.estimate"),
    **dict.fromkeys(["BACKENDS", "BACKEND_INPUTS", "Rollout", "RolloutReport"], "unipg.runtime"),
    **dict.fromkeys(["Registry", "FactoryRegistry", "RegistryError"], "unipg.registry"),
    "CHECKS": "unipg.observe",
    "ALGORITHMS": "unipg.config",
    "UnipgDeprecationWarning": "unipg._moved",
}

__all__ = ["Config", "ConfigError", "RunResult", "evaluate", "load_config", "train", *_PUBLIC]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'unipg' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
