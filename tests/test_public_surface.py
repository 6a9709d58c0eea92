"""The public extension surface: what plugins import, pinned name by name. Deeper module paths are internal and
may move; these names stay, and a moved path keeps working for one release with a warning naming the new one."""

import importlib
import subprocess
import sys
import textwrap

import pytest

import unipg

SURFACE = {
    "unipg": [
        "ADVANTAGES",
        "ALGORITHMS",
        "BACKENDS",
        "BACKEND_INPUTS",
        "CHECKS",
        "Config",
        "ConfigError",
        "ENGINES",
        "ENVS",
        "Engine",
        "Env",
        "EnvironmentService",
        "Example",
        "FactoryRegistry",
        "KL_ESTIMATORS",
        "LatencyModel",
        "OFF_POLICY_WEIGHTS",
        "POLICY_LOSSES",
        "REWARDS",
        "Registry",
        "RegistryError",
        "RewardFunctionError",
        "RoleEnv",
        "Rollout",
        "RolloutReport",
        "RunResult",
        "SamplingParams",
        "StepResult",
        "TASKS",
        "TOOLS",
        "TOOL_PARSERS",
        "Task",
        "Tool",
        "ToolError",
        "TurnInfo",
        "TurnOutput",
        "UnipgDeprecationWarning",
        "build_rewards",
        "evaluate",
        "load_config",
        "make_task",
        "tool",
        "train",
    ],
    "unipg.tasks": [
        "CombinedReward",
        "Example",
        "REWARDS",
        "RewardFunction",
        "RewardFunctionError",
        "TASKS",
        "Task",
        "build_rewards",
        "make_task",
        "text_of",
    ],
    "unipg.tools": [
        "LatencyModel",
        "MalformedToolCall",
        "TOOLS",
        "TOOL_PARSERS",
        "Tool",
        "ToolCall",
        "ToolError",
        "format_tool_call",
        "names_its_tools",
        "tool",
    ],
    "unipg.envs": ["ENVS", "Env", "EnvironmentService", "RoleEnv", "StepResult", "ToolCallResult", "TurnInfo"],
    "unipg.inference": ["ENGINES", "Engine", "HFService", "SamplingParams", "TurnOutput"],
    "unipg.runtime": ["BACKENDS", "BACKEND_INPUTS", "Rollout", "RolloutReport"],
    "unipg.observe": ["CHECKS", "Check", "Finding"],
}


@pytest.mark.parametrize("module", sorted(SURFACE))
def test_each_public_module_exports_exactly_the_pinned_names_and_each_resolves(module):
    imported = importlib.import_module(module)
    assert sorted(imported.__all__) == sorted(SURFACE[module])
    for name in SURFACE[module]:
        assert getattr(imported, name) is not None


def test_the_top_level_names_are_the_objects_of_the_rooms():
    from unipg.estimate import ADVANTAGES
    from unipg.tasks import TASKS
    from unipg.tools import tool

    assert unipg.TASKS is TASKS and unipg.tool is tool and unipg.ADVANTAGES is ADVANTAGES
    assert "TASKS" in dir(unipg)
    with pytest.raises(AttributeError, match="no attribute 'TASK'"):
        unipg.TASK  # noqa: B018


def run_plugin(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


def test_a_plugin_importing_moved_paths_works_with_a_warning_naming_each_new_path():
    """The import lines of a plugin task from before the rooms: they work, share the registries, and each old
    path warns once, pointing at the plugin's own line (FutureWarning: shown by default)."""
    done = run_plugin("""
        from unipg.sample.tasks import TASKS, Example, Task
        from unipg.sample.tasks.base import TASKS as BASE_TASKS
        from unipg.sample.tools import TOOLS, ToolError, tool
        from unipg.sample.rewards import REWARDS
        from unipg.sample.envs import ENVS, StepResult
        from unipg.estimate.registry import Registry
        import unipg
        assert TASKS is BASE_TASKS is unipg.TASKS and TOOLS is unipg.TOOLS and REWARDS is unipg.REWARDS
        assert ENVS is unipg.ENVS and Registry is unipg.Registry
        print("imported")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "imported"
    warned = [line for line in done.stderr.splitlines() if "UnipgDeprecationWarning" in line]
    assert len(warned) == 6
    assert "<string>:2: UnipgDeprecationWarning: 'unipg.sample.tasks' moved to 'unipg.tasks'" in warned[0]
    assert "'unipg.sample.tasks.base' moved to 'unipg.tasks.base'" in warned[1]
    assert "'unipg.estimate.registry' moved to 'unipg.registry'" in warned[5]


def test_a_moved_module_is_the_same_module_object_not_a_second_copy(monkeypatch):
    monkeypatch.delitem(sys.modules, "unipg.sample.engines", raising=False)  # warned once per process
    with pytest.warns(unipg.UnipgDeprecationWarning, match="unipg.inference"):
        old = importlib.import_module("unipg.sample.engines")
    assert old is importlib.import_module("unipg.inference")


def test_a_path_that_never_existed_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("unipg.sample.nothing_here")
