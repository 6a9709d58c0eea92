"""A run whose agents use the tools of an MCP server starts the server and stops it when the run ends."""

import json
import sys

import pytest

from tests.helpers.configs import TWO_EVALUATED_UPDATES
from tests.helpers.mcp import SERVER, server_pids
from tests.helpers.processes import is_running
from unipg.config import load_config
from unipg.runtime.lm import train_lm

pytestmark = pytest.mark.e2e


def test_every_mcp_server_a_run_starts_is_stopped_when_it_ends(embedded_path, tmp_path):
    pid_file = tmp_path / "servers.pid"
    tools = json.dumps(
        [
            {
                "name": "mcp",
                "server": {"command": sys.executable, "args": [str(SERVER), str(pid_file)]},
                "options": {"include": ["add"]},
            }
        ]
    )
    config = load_config(
        None,
        TWO_EVALUATED_UPDATES
        + [
            "task.name=calculator",
            "task.options={digits: 1, num_train: 16, num_test: 4}",
            f"task.tools={tools}",
            "train.updates=1",
            "agent.max_total_tokens=24",
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
        ],
    )
    result = train_lm(config)
    assert result.updates == 1
    pids = server_pids(pid_file)
    assert pids and not any(is_running(pid) for pid in pids)
