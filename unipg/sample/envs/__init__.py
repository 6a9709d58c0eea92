"""Multi-turn text environments (``Env``), their registry, and the environment service for tool calls."""

from unipg.sample.envs import gym_env, single_turn, solver_checker, tool_env  # noqa: F401  (register the built-in environments)
from unipg.sample.envs.base import ENVS, Env, StepResult
from unipg.sample.envs.service import EnvironmentService, ToolCallResult

__all__ = ["ENVS", "Env", "EnvironmentService", "StepResult", "ToolCallResult"]
