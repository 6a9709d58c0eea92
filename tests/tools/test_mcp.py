"""Tools of an MCP server: a real server (``mcp_server.py``, written with the MCP SDK) over stdio."""

import asyncio
import json
import subprocess
import sys

import pytest

from tests.helpers.mcp import SERVER, server_pids, server_spec
from tests.helpers.processes import is_running
from tests.helpers.scripted import ScriptedEngine
from unipg.config import ConfigError, load_config
from unipg.envs import EnvironmentService
from unipg.envs.service import build_tools, close_tools
from unipg.envs.tool_env import ToolEnv
from unipg.policy.chat import TurnTemplate
from unipg.policy.embedded import build_tokenizer
from unipg.sample.agent import AgentLoop
from unipg.sample.validate import check_sample_options
from unipg.tasks.base import Example
from unipg.tasks.rewards.rules import build_rewards


@pytest.fixture(scope="module")
def tools():
    built = build_tools([server_spec()])
    yield built
    close_tools(built)


def test_every_tool_the_server_lists_becomes_a_tool_with_its_schema(tools):
    assert sorted(tools) == ["add", "fail", "lookup", "slow"]
    add = tools["add"].schema()["function"]
    assert add["name"] == "add" and add["description"] == "Add two integers."
    assert add["parameters"]["properties"]["a"]["type"] == "integer" and add["parameters"]["required"] == ["a", "b"]
    assert tools["add"].check_arguments({"a": 1, "b": "two"}) == "argument 'b' must be integer, got string"


def test_calls_from_several_event_loops_reach_the_server(tools):
    service = EnvironmentService(tools, timeout=20, retries=0)
    assert asyncio.run(service.call("add", {"a": 2, "b": 40})).observation == "42"
    result = asyncio.run(service.call("lookup", {"word": "lima"}))  # a second loop, as the next batch runs on
    assert result.ok and result.observation == "the capital of Peru"


def test_an_error_result_is_a_refusal_shown_to_the_agent(tools):
    service = EnvironmentService(tools, timeout=20, retries=2)
    result = asyncio.run(service.call("lookup", {"word": "zebra"}))
    assert result.status == "error" and result.attempts == 1 and "no entry for 'zebra'" in result.observation
    assert service.stats.errors == 1 and service.stats.failures == 0


def test_a_call_past_the_timeout_is_retried_then_fails_as_any_tool_does(tools):
    service = EnvironmentService(tools, timeout=0.5, retries=1, backoff=0.01, failure_penalty=0.3)
    result = asyncio.run(service.call("slow", {"seconds": 30}))
    assert (result.status, result.attempts, result.timeouts, result.penalty) == ("failed", 2, 2, -0.3)
    assert asyncio.run(service.call("add", {"a": 1, "b": 1})).observation == "2"  # the session is still usable
    assert service.stats.failures == 1 and service.stats.timeouts == 2


def test_an_agent_episode_calls_the_server_and_gets_the_result_as_its_observation(tmp_path):
    pid_file = tmp_path / "server.pid"
    service = EnvironmentService.from_specs([server_spec(pid_file, include=["add"])], timeout=20)
    tokenizer = build_tokenizer()
    call = '<tool_call>{"name": "add", "arguments": {"a": 19, "b": 23}}</tool_call>'
    engine = ScriptedEngine(tokenizer, [call, "The sum is 42."], keep_stop=("</tool_call>",))
    template = TurnTemplate(tokenizer)
    loop = AgentLoop(
        engine,
        template,
        lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
        max_turns=3,
        max_new_tokens=64,
        max_total_tokens=400,
    )
    env = ToolEnv(build_rewards([{"name": "math"}]), service)
    example = Example("<|user|>What is 19+23?<|end|><|assistant|>", "42", "", {"answer": "42"})
    try:
        assert sorted(service.tools) == ["add"]  # include: only the tools named
        [trajectory] = asyncio.run(loop.run_episodes([env], [example]))
        [pid] = server_pids(pid_file)
        assert is_running(pid)
    finally:
        service.close()
    assert trajectory.infos[0].tool_status == "ok" and trajectory.finish == "done" and trajectory.correct
    second_context = tokenizer.decode(engine.contexts[1])
    assert second_context.endswith(call + template.closing(False) + template.observation("42"))
    assert not is_running(pid)  # the server stops with the service


def test_a_server_that_cannot_start_says_why():
    with pytest.raises(ValueError, match="could not be started"):
        build_tools([{"name": "mcp", "server": {"command": "/nonexistent/mcp-server"}}])
    with pytest.raises(ValueError, match="has no tool subtract; it offers add, fail, lookup, slow"):
        build_tools([server_spec(include=["subtract"])])


def test_a_server_that_never_answers_is_stopped_after_the_startup_timeout(tmp_path):
    pid_file = tmp_path / "server.pid"
    silent = f"import os, time; open({str(pid_file)!r}, 'a').write(f'{{os.getpid()}}\\n'); time.sleep(120)"
    with pytest.raises(ValueError, match="did not answer within 2 s"):
        build_tools(
            [
                {
                    "name": "mcp",
                    "server": {"command": sys.executable, "args": ["-c", silent]},
                    "options": {"startup_timeout": 2},
                }
            ]
        )
    assert not any(is_running(pid) for pid in server_pids(pid_file))


def test_the_config_checks_the_server_settings():
    spec = json.dumps([server_spec(include=["add"])])
    check_sample_options(load_config(None, ["task.name=arithmetic", f"task.tools={spec}"]))  # accepted, not started
    bad = json.dumps([{"name": "calculator", "server": {}}, {"name": "mcp"}])
    with pytest.raises(ConfigError) as raised:
        check_sample_options(load_config(None, ["task.name=calculator", f"task.tools={bad}"]))
    assert "task.tools[0]: tool 'calculator' has no option 'server'" in str(raised.value)
    assert "task.tools[1]: tool 'mcp' needs the option(s) server" in str(raised.value)


def test_the_config_refuses_a_server_that_would_not_offer_a_tool_the_demonstrations_call():
    """The calculator task's demonstrations call ``calculator``: a server configured to offer only ``add`` would
    leave those calls without a tool, and one without include cannot be checked before it starts."""

    def check(*specs: dict) -> None:
        check_sample_options(load_config(None, ["task.name=calculator", f"task.tools={json.dumps(list(specs))}"]))

    with pytest.raises(
        ConfigError,
        match=r"the demonstrations of task 'calculator' call calculator, which task.tools "
        r"does not offer \(it offers add\)",
    ):
        check(server_spec(include=["add"]))
    with pytest.raises(
        ConfigError,
        match=r"task.tools\[0\] \(mcp\) offers what its server lists; name the tools in "
        r"its include option \(e.g. include: \[calculator\]\)",
    ):
        check(server_spec())
    check(server_spec(include=["add"]), {"name": "calculator"})  # offered beside the server's: accepted, not started


def test_a_copy_in_another_process_starts_its_own_server_on_its_first_call(tools):
    """Ray ships tools to environment actors by pickling them: the copy connects where it is called."""
    import cloudpickle

    copies = cloudpickle.loads(cloudpickle.dumps(tools))
    try:
        assert copies["add"].close.__self__ is not tools["add"].close.__self__  # another server
        assert copies["add"].close.__self__ is copies["lookup"].close.__self__  # one per copied server
        service = EnvironmentService(copies, timeout=30, retries=0)
        assert asyncio.run(service.call("add", {"a": 1, "b": 2})).observation == "3"
        assert asyncio.run(EnvironmentService(tools, timeout=20).call("add", {"a": 2, "b": 2})).observation == "4"
    finally:
        close_tools(copies)


NOISY = r"""
import asyncio, sys
from tests.helpers.mcp import SERVER
from unipg.envs import EnvironmentService
from unipg.envs.service import build_tools, close_tools

def spec(*flags, timeout=20):
    server = {"command": sys.executable, "args": [str(SERVER), "--garbage", "500", *flags]}
    return {"name": "mcp", "server": server, "options": {"startup_timeout": timeout}}

tools = build_tools([spec()])  # it prints 500 lines to stdout, then serves
print("add:", asyncio.run(EnvironmentService(tools, timeout=20).call("add", {"a": 2, "b": 3})).observation)
close_tools(tools)
try:
    build_tools([spec("--mute", timeout=12)])  # it prints 500 lines to stdout, then never answers
except ValueError as error:
    print(error, file=sys.stderr)
"""


def test_a_server_writing_other_lines_to_stdout_logs_the_first_and_counts_the_rest():
    # in a fresh interpreter: the SDK logs through Python's default handler to stderr, as in a plain run
    child = subprocess.run(
        [sys.executable, "-c", NOISY], cwd=SERVER.parents[2], capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout == "add: 5\n"
    lines = child.stderr.splitlines()
    first = "wrote a line to stdout that is not a JSON-RPC message: 'starting up, step 0'"
    counted = "it wrote 500 lines to stdout that are not JSON-RPC messages (the first is logged above)"
    assert len(lines) == 4, lines  # not a traceback per line
    assert first in lines[0] and lines[1].endswith(f"--garbage 500' ended; {counted}")
    assert first in lines[2] and lines[3].endswith(f"--mute' did not answer within 12 s; {counted}")
