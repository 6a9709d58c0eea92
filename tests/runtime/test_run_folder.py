"""A run folder is data: reading its configuration (to evaluate or to resume it) never lets it run code."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

import unipg.api
from unipg.cli import app
from unipg.config import load_config
from unipg.observe.metrics import MetricsLogger

SMALL = [
    "task.name=arithmetic",
    "task.options={digits: 1, num_train: 16, num_test: 4}",
    "log.monitor=false",
    "log.tensorboard=false",
    "model.trust_remote_code=true",
]


def saved_run(tmp_path: Path, overrides: list[str] = SMALL) -> Path:
    run = tmp_path / "run"
    logger = MetricsLogger(run, tensorboard=False)
    logger.write_config(load_config(None, overrides).to_dict())
    logger.close()
    (run / "policy").mkdir()
    return run


@pytest.mark.parametrize("read", ["evaluation", "resume"])
def test_a_run_folder_cannot_turn_on_remote_code_but_the_user_can(tmp_path, read):
    run, notices = saved_run(tmp_path), []
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["trust_remote_code"] is True
    load = unipg.api.evaluation_config if read == "evaluation" else unipg.api.resumed_config

    config = load(run, notify=notices.append)
    assert config.model.trust_remote_code is False
    assert len(notices) == 1 and "model.trust_remote_code" in notices[0] and str(run) in notices[0]
    assert "\n" not in notices[0]

    notices.clear()
    assert load(run, overrides=["model.trust_remote_code=true"], notify=notices.append).model.trust_remote_code
    assert load(run, model__trust_remote_code=True, notify=notices.append).model.trust_remote_code
    assert notices == []


def test_no_notice_when_the_folder_did_not_ask_for_remote_code(tmp_path):
    run, notices = saved_run(tmp_path, SMALL[:-1]), []
    assert not unipg.api.resumed_config(run, notify=notices.append).model.trust_remote_code
    assert not unipg.api.evaluation_config(run, notify=notices.append).model.trust_remote_code
    assert notices == []


def test_eval_and_resume_on_the_command_line_say_so_and_load_without_remote_code(tmp_path, monkeypatch):
    run, seen = saved_run(tmp_path), []
    monkeypatch.setattr(
        unipg.api, "evaluate_episodes", lambda config, show: seen.append(config) or ({"eval/pass@1": 1.0}, [])
    )
    monkeypatch.setattr(
        unipg.api,
        "run",
        lambda config, **options: seen.append(config) or (_ for _ in ()).throw(ValueError("stopped here")),
    )

    evaluated = CliRunner().invoke(app, ["eval", "--run", str(run)])
    assert evaluated.exit_code == 0, evaluated.output
    resumed = CliRunner().invoke(app, ["train", "--resume", str(run)])
    assert resumed.exit_code == 2 and "stopped here" in resumed.output
    assert [config.model.trust_remote_code for config in seen] == [False, False]
    for result in (evaluated, resumed):
        assert "notice:" in result.output and "model.trust_remote_code=true" in result.output

    seen.clear()
    trusted = CliRunner().invoke(app, ["eval", "--run", str(run), "model.trust_remote_code=true"])
    assert trusted.exit_code == 0 and "notice:" not in trusted.output
    CliRunner().invoke(app, ["train", "--resume", str(run), "model.trust_remote_code=true"])
    assert [config.model.trust_remote_code for config in seen] == [True, True]


def test_train_resume_in_python_reads_the_folder_without_remote_code(tmp_path, monkeypatch):
    run, seen = saved_run(tmp_path), []
    monkeypatch.setattr(
        unipg.api,
        "run",
        lambda config, **options: seen.append(config) or (_ for _ in ()).throw(ValueError("stopped here")),
    )
    with pytest.raises(ValueError, match="stopped here"):
        unipg.api.train(resume=run)
    with pytest.raises(ValueError, match="stopped here"):
        unipg.api.train(resume=run, model__trust_remote_code=True)
    assert [config.model.trust_remote_code for config in seen] == [False, True]


def planted_run(tmp_path: Path, **planted) -> tuple[Path, Path]:
    """A saved run whose config.yaml was edited to name code; each piece of code, if run, touches ``marker``."""
    run, marker = saved_run(tmp_path, SMALL[:-1]), tmp_path / "code-ran"
    (run / "planted.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).touch()\n\nasync def run(*a):\n    return 0.0\n"
    )
    tree = yaml.safe_load((run / "config.yaml").read_text())
    if planted.get("plugin"):
        tree["plugins"] = ["./planted.py"]  # relative: resolved inside the folder
    if planted.get("agent"):
        tree["task"]["agent"] = f"{run / 'planted.py'}:run"
    if planted.get("server"):
        server = {"command": "python", "args": [str(run / "planted.py")]}
        tree["task"]["tools"] = [{"name": "mcp", "server": server}]
    if planted.get("isolation"):
        tree["task"]["tools"] = [{"name": "python", "options": {"isolation": "process"}}]
    if planted.get("remote"):
        tree["endpoint"] = {"host": "0.0.0.0", "allow_remote": True}
    if planted.get("runtime_env"):
        tree.setdefault("ray", {})["runtime_env"] = {"pip": ["evil-package"], "env_vars": {"A": "1"}}
    (run / "config.yaml").write_text(yaml.safe_dump(tree))
    return run, marker


@pytest.mark.parametrize("command", ["eval", "resume"])
@pytest.mark.parametrize("planted", ["agent", "server", "runtime_env", "isolation", "remote"])
def test_a_run_folder_that_names_an_agent_a_server_or_ray_code_is_refused_and_runs_nothing(
    tmp_path, monkeypatch, command, planted
):
    if command == "eval" and planted == "runtime_env":
        pytest.skip("evaluation reads no ray section")
    run, marker = planted_run(tmp_path, plugin=True, **{planted: True})
    monkeypatch.setattr(unipg.api, "evaluate_episodes", lambda config, show: pytest.fail("evaluated"))
    monkeypatch.setattr(unipg.api, "run", lambda config, **options: pytest.fail("trained"))
    args = ["eval", "--run", str(run)] if command == "eval" else ["train", "--resume", str(run)]

    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert not marker.exists()
    key = {
        "agent": "task.agent",
        "server": "task.tools[0].server",
        "runtime_env": "ray.runtime_env.pip",
        "isolation": "task.tools[0].options.isolation",
        "remote": "endpoint.allow_remote",
    }[planted]
    assert key in result.output and "--trust-folder-code" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("read", ["evaluation", "resume"])
def test_a_run_folders_plugins_are_skipped_with_a_notice_unless_the_user_names_them(tmp_path, read):
    run, marker = planted_run(tmp_path, plugin=True)
    load = unipg.api.evaluation_config if read == "evaluation" else unipg.api.resumed_config
    notices = []

    config = load(run, notify=notices.append)
    assert not marker.exists() and config.plugins == []
    assert len(notices) == 1 and str(run / "planted.py") in notices[0] and "--import" in notices[0]

    if read == "resume":  # named again with --import: imported
        config = unipg.api.resumed_config(run, notify=notices.append, plugins=[str(run / "planted.py")])
    else:
        config = load(run, notify=notices.append, trust_code=True)
    assert marker.exists() and config.plugins == [str(run / "planted.py")]


def test_an_override_of_the_agent_replaces_the_folders_and_trust_takes_it(tmp_path):
    run, marker = planted_run(tmp_path, agent=True)
    config = unipg.api.resumed_config(run, overrides=["task.agent=null"], notify=pytest.fail)
    assert config.task.agent is None and not marker.exists()
    assert unipg.api.resumed_config(run, trust_code=True, notify=pytest.fail).task.agent.endswith("planted.py:run")


def test_a_plugin_the_run_needs_is_named_in_the_error(tmp_path):
    run, marker = planted_run(tmp_path, plugin=True)
    tree = yaml.safe_load((run / "config.yaml").read_text())
    tree["task"]["name"] = "planted_task"
    (run / "config.yaml").write_text(yaml.safe_dump(tree))
    result = CliRunner().invoke(app, ["train", "--resume", str(run)])
    assert result.exit_code == 2 and not marker.exists()
    assert "planted_task" in result.output and "--import" in result.output and "Traceback" not in result.output


def test_eval_of_a_folder_whose_weights_are_truncated_says_so_in_one_line(tmp_path, embedded_path):
    import shutil

    run = saved_run(tmp_path, SMALL[:-1])
    shutil.rmtree(run / "policy")
    shutil.copytree(embedded_path, run / "policy")
    weights = run / "policy" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    result = CliRunner().invoke(app, ["eval", "--run", str(run)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "model.safetensors" in result.output or "SafetensorError" in result.output
