"""MCP tools on the Ray backend: an environment actor runs the calls on a server of its own, which does not
outlive the actor."""

import asyncio
import time

import pytest

from tests.helpers.mcp import server_pids, server_spec
from tests.helpers.processes import is_running
from unipg.envs import EnvironmentService
from unipg.envs.service import build_tools, close_tools

ray = pytest.importorskip("ray")


def test_an_environment_actor_calls_mcp_tools_on_its_own_server(tmp_path):
    from unipg.runtime.backends.ray_actors import EnvActor, EnvPool

    pid_file = tmp_path / "servers.pid"
    tools = build_tools([server_spec(pid_file, include=["add"])])
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        actor = ray.remote(EnvActor).options(num_cpus=0).remote(tools)  # the tools travel pickled
        ray.get(actor.ready.remote(), timeout=120)
        service = EnvironmentService(tools, timeout=60, retries=0, remote=EnvPool([actor], health_timeout=60.0))
        result = asyncio.run(service.call("add", {"a": 20, "b": 22}))
        assert result.ok and result.observation == "42"
        here, there = server_pids(pid_file)  # this process's server, then the actor's own
        ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + 60
        while is_running(there) and time.monotonic() < deadline:  # its input closes with the actor: it exits
            time.sleep(0.2)
        assert not is_running(there) and is_running(here)
    finally:
        close_tools(tools)
        ray.shutdown()
    assert not is_running(here)
