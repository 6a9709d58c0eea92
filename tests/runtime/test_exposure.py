"""What a run exposes: no network listener beyond loopback, and no secret in the files it leaves behind."""

from __future__ import annotations

import ipaddress
import socket
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.helpers.configs import tiny_lm_overrides
from unipg.cli import app
from unipg.config import ConfigError, load_config
from unipg.config.secrets import REDACTED, is_secret_name, redact_secrets
from unipg.observe.metrics import MetricsLogger
from unipg.runtime.lm import train_lm

psutil = pytest.importorskip("psutil")

SMALL = tiny_lm_overrides(
    "train.micro_batch_size=8",
    "train.updates=1",
    "eval.pass_k=0",
    "algorithm=grpo",
    "log.tensorboard=true",
    num_train=16,
    num_test=4,
)
ENVIRONMENT_SECRET = "env-sentinel-4f2c9a7e1b"
CONFIG_SECRETS = {"WANDB_API_KEY": "config-sentinel-8d31e6", "HF_TOKEN": "config-sentinel-c07b52"}
SECRET_OVERRIDE = "ray.runtime_env={env_vars: {WANDB_API_KEY: %s, HF_TOKEN: %s}}" % tuple(CONFIG_SECRETS.values())


def listening_sockets() -> set[tuple[str, str, int]]:
    """(process name, address, port) of every TCP socket listening, and every unconnected UDP socket, of this
    process and its descendants."""
    found = set()
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            name, connections = process.name(), process.net_connections(kind="inet")
        except psutil.Error:
            continue  # it ended while we looked
        for connection in connections:
            if connection.status == psutil.CONN_LISTEN or (
                connection.type == socket.SOCK_DGRAM and not connection.raddr
            ):
                found.add((name, connection.laddr.ip, connection.laddr.port))
    return found


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1, from a dual-stack socket
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


@pytest.mark.e2e
def test_a_training_run_with_wandb_opens_no_listener_and_leaves_no_secret_in_its_folder(
    embedded_path, tmp_path, monkeypatch
):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_API_KEY", ENVIRONMENT_SECRET)
    # as if the secrets were passed on the command line, which W&B would otherwise record with the run
    monkeypatch.setattr(sys, "argv", ["unipg", "train", SECRET_OVERRIDE])
    before = listening_sockets()
    during = []
    write_config = MetricsLogger.write_config

    def write_and_look(logger, config):
        write_config(logger, config)  # starts W&B's background service
        during.append(listening_sockets())

    monkeypatch.setattr(MetricsLogger, "write_config", write_and_look)
    config = load_config(
        None,
        SMALL
        + [
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            "log.wandb=true",
            "log.wandb_mode=offline",
            "log.tensorboard=true",
            "checkpoint.every_updates=1",
            SECRET_OVERRIDE,
        ],
    )
    result = train_lm(config)

    assert during and during[0] - before == set()
    assert listening_sockets() - before == set()
    assert config.ray.runtime_env["env_vars"] == CONFIG_SECRETS  # the run keeps its real values
    run = result.run_dir
    files = [path for path in run.rglob("*") if path.is_file()]
    for folder in ("checkpoints", "tensorboard", "wandb"):
        assert any(folder in path.relative_to(run).parts for path in files), f"no {folder} files to check"
    for path in files:
        content = path.read_bytes()
        for secret in (ENVIRONMENT_SECRET, *CONFIG_SECRETS.values()):
            assert secret.encode() not in content, f"{secret} found in {path.relative_to(run)}"
    saved = load_yaml(run / "config.yaml")
    assert saved["ray"]["runtime_env"]["env_vars"] == {"WANDB_API_KEY": REDACTED, "HF_TOKEN": REDACTED}
    (events,) = (run / "tensorboard").iterdir()
    assert REDACTED.encode() in events.read_bytes()  # the TensorBoard config text
    (wandb_run,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    assert REDACTED.encode() in wandb_run.read_bytes()  # the W&B run's config


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def test_a_redacted_secret_is_read_from_an_override_or_the_environment_or_refused(tmp_path, monkeypatch):
    run = tmp_path / "run"
    logger = MetricsLogger(run, tensorboard=False)
    logger.write_config(load_config(None, SMALL + ["log.monitor=false", SECRET_OVERRIDE]).to_dict())
    logger.close()
    saved = run / "config.yaml"
    for name in CONFIG_SECRETS:
        monkeypatch.delenv(name, raising=False)

    with pytest.raises(
        ConfigError, match="ray.runtime_env.env_vars.WANDB_API_KEY, ray.runtime_env.env_vars.HF_TOKEN"
    ) as refused:
        load_config(saved)
    assert "override" in str(refused.value) and "environment variable" in str(refused.value)
    resumed = CliRunner().invoke(app, ["train", "--resume", str(run)])
    assert resumed.exit_code == 2 and "ray.runtime_env.env_vars.WANDB_API_KEY" in resumed.output

    monkeypatch.setenv("HF_TOKEN", "from-the-environment")
    config = load_config(saved, ["ray.runtime_env.env_vars.WANDB_API_KEY=from-an-override"])
    assert config.ray.runtime_env["env_vars"] == {
        "WANDB_API_KEY": "from-an-override",
        "HF_TOKEN": "from-the-environment",
    }


def test_secret_names_are_told_apart_from_the_schemas_own_keys():
    for name in ("WANDB_API_KEY", "api_key", "apiKey", "HFToken", "hf_token", "db_password", "client_secret", "apikey"):
        assert is_secret_name(name), name
    for name in (
        "max_new_tokens",
        "max_total_tokens",
        "keep_last",
        "best_metric",
        "tokenizer",
        "output_dir",
        "pad_token",
        "eos_token",
        "answer_key",
        "num_keys",
        "monkey",
    ):  # options a task or reward may take
        assert not is_secret_name(name), name
    for overrides in ([], ["task.name=arithmetic"], ["task.name=calculator", "task.tools=[{name: calculator}]"]):
        plain = load_config(None, overrides).to_dict()
        assert redact_secrets(plain) == plain  # nothing of the schema itself is taken for a secret
    assert redact_secrets(
        {"token": True, "api_key": None, "password": "", "credentials": {"user": "u", "ids": [1, 2]}}
    ) == {"token": True, "api_key": None, "password": "", "credentials": {"user": REDACTED, "ids": [1, 2]}}


def test_a_local_ray_instance_listens_on_loopback_and_passes_real_secrets_to_workers():
    ray = pytest.importorskip("ray")
    from unipg.runtime.backends.ray_lm import connect

    if ray.is_initialized():
        pytest.skip("Ray is already connected in this process; this test starts its own local instance")
    settings = load_config(
        None,
        [
            "task.name=arithmetic",
            "backend=ray",
            "ray.num_cpus=1",
            "ray.runtime_env={env_vars: {UNIPG_TEST_TOKEN: real-value}}",
        ],
    ).ray
    before = listening_sockets()
    assert connect(settings)
    try:
        seen = ray.get(ray.remote(lambda: __import__("os").environ.get("UNIPG_TEST_TOKEN")).remote(), timeout=60)
        listeners = listening_sockets() - before
    finally:
        ray.shutdown()
    assert seen == "real-value"
    assert {"gcs_server", "raylet"} <= {name for name, _, _ in listeners}  # the servers were found
    assert [entry for entry in listeners if not is_loopback(entry[1])] == []


def test_evaluating_a_run_does_not_ask_for_secrets_only_training_reads(embedded_path, tmp_path, monkeypatch):
    from unipg.runtime.evaluation import run_config

    run = tmp_path / "run"
    logger = MetricsLogger(run, tensorboard=False)
    logger.write_config(
        load_config(None, SMALL + [f"model.name={embedded_path}", "log.monitor=false", SECRET_OVERRIDE]).to_dict()
    )
    logger.close()
    (run / "policy").mkdir()
    for name in CONFIG_SECRETS:
        monkeypatch.delenv(name, raising=False)

    config = run_config(run, [])  # the Ray runtime_env's secrets are training's, not evaluation's
    assert config.model.name == str(run / "policy") and config.ray.runtime_env["env_vars"] == {}
    saved = load_yaml(run / "config.yaml")
    saved["task"]["options"]["api_key"] = REDACTED
    (run / "config.yaml").write_text(yaml.safe_dump(saved), encoding="utf-8")
    with pytest.raises(ConfigError, match="task.options.api_key"):  # a secret evaluation reads is still asked for
        run_config(run, [])
