"""A tool is offered under the name it is registered and configured under, whatever its function is called; an entry
that names its tools itself (an MCP server's, ``faulty``) is checked against the task's demonstrations at load."""

from __future__ import annotations

import asyncio
import sys
import textwrap

import pytest

import unipg
from unipg.config import ConfigError
from unipg.envs import ENVS, EnvironmentService
from unipg.envs.service import build_tools, close_tools
from unipg.tasks import TASKS
from unipg.tasks.base import Example
from unipg.tasks.rewards.rules import build_rewards
from unipg.tools import TOOLS, tool

# A plugin whose tool is registered as "unit_convert" over a function named convert_units, with a task whose
# demonstrations call it by the registered name.
PLUGIN = textwrap.dedent('''
    from unipg.tasks import TASKS, Example, Task
    from unipg.tools import TOOLS, format_tool_call, tool


    def convert_units(kilometres: float) -> str:
        """Kilometres in metres.

        Args:
            kilometres: the distance in km.
        """
        return str(int(kilometres * 1000))


    @TOOLS.register("unit_convert")
    def unit_convert_tool():
        return tool(convert_units)


    @TASKS.register("metres")
    def metres_task() -> Task:
        def example(km):
            call = format_tool_call("unit_convert", {"kilometres": km})
            solution = [{"role": "assistant", "content": call}, {"role": "tool", "content": str(km * 1000)},
                        {"role": "assistant", "content": str(km * 1000)}]
            return Example(f"How many metres are {km} km?", str(km * 1000), solution, {"answer": str(km * 1000)})

        return Task("metres", [example(km) for km in (1, 2, 3)], [example(4)], system_prompt=None,
                    rewards=[{"name": "math"}], tools=[{"name": "unit_convert"}], max_turns=2)
''')


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The plugin file; what it registers is undone after the test."""
    for registry in (TASKS, TOOLS):
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))
    path = tmp_path / "metres_plugin.py"
    path.write_text(PLUGIN, encoding="utf-8")
    yield path
    for name in [name for name in sys.modules if name.startswith("unipg_plugin_metres_plugin_")]:
        del sys.modules[name]


def test_a_tool_registered_under_another_name_than_its_function_is_offered_under_it(plugin):
    unipg.load_config(None, plugins=[str(plugin)], overrides=["task.name=metres"])  # registers the plugin
    task = unipg.make_task("metres")
    service = EnvironmentService(build_tools(task.tools), timeout=5.0, retries=0)
    try:
        assert list(service.tools) == ["unit_convert"]
        assert service.tools["unit_convert"].schema()["function"]["name"] == "unit_convert"
        env = ENVS.get("tool")(task, build_rewards(task.rewards), service)

        async def play(example: Example):
            await env.reset(example)
            turns = [message["content"] for message in example.solution if message["role"] == "assistant"]
            return [await env.step(turn) for turn in turns]

        call, answer = asyncio.run(play(task.test[0]))
        assert call.info.tool_status == "ok" and call.observation == "4000"
        assert answer.done and answer.reward == 1.0
    finally:
        service.close()


def test_faulty_offers_the_wrapped_tools_name_and_two_tools_of_one_name_are_refused(monkeypatch):
    monkeypatch.setattr(TOOLS, "_entries", dict(TOOLS._entries))
    TOOLS.register("adder")(lambda: tool(add_numbers))
    tools = build_tools([{"name": "faulty", "options": {"tool": "adder"}}])
    assert list(tools) == ["adder"] and asyncio.run(tools["adder"].function(a=2, b=3)) == "5"
    with pytest.raises(ValueError, match="two tool entries offer a tool named 'adder' \\(the second: faulty\\)"):
        build_tools([{"name": "adder"}, {"name": "faulty", "options": {"tool": "adder"}}])
    close_tools(tools)


def test_a_faulty_tool_the_demonstrations_do_not_call_is_refused_at_load():
    with pytest.raises(
        ConfigError,
        match=r"the demonstrations of task 'calculator' call calculator, which task.tools "
        r"does not offer \(it offers python\)",
    ):
        unipg.load_config(
            None,
            overrides=["task.name=calculator", "task.tools=[{name: faulty, options: {tool: python, raise_rate: 0.1}}]"],
        )
    unipg.load_config(
        None,
        overrides=["task.name=calculator", "task.tools=[{name: faulty, options: {tool: calculator, raise_rate: 0.1}}]"],
    )


def add_numbers(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return str(a + b)
