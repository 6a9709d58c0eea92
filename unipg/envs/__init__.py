"""What answers the policy: multi-turn text environments (``Env``, ``RoleEnv``), their registry ``ENVS``, and the
environment service for tool calls (timeouts, retries, default observation, failure penalty)."""

from unipg.envs import gym_env, single_turn, solver_checker, tool_env  # noqa: F401  (register the built-in environments)
from unipg.envs.base import ENVS, Env, RoleEnv, StepResult, TurnInfo
from unipg.envs.service import EnvironmentService, ToolCallResult

__all__ = ["ENVS", "Env", "EnvironmentService", "RoleEnv", "StepResult", "ToolCallResult", "TurnInfo"]
