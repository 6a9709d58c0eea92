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
