"""Which values a run saves redacted: environment variables unless kept in clear, and credentials by their form."""

from __future__ import annotations

import json

import pytest
import yaml

from unipg.config import ConfigError, load_config
from unipg.config.secrets import CLEAR_ENV_VARS, REDACTED, looks_like_secret, redact_secrets
from unipg.observe.metrics import MetricsLogger

SECRET_ENV_NAMES = (
    "OPENAI_API_KEY",
    "MY_KEY",
    "GITHUB_PAT",
    "DATABASE_URL",
    "SLACK_WEBHOOK_URL",
    "SESSION_COOKIE",
    "AUTH_HEADER",
    "DB_PASSWORD",
    "ANTHROPIC_API_KEY",
    "HF_TOKEN",
    "SOME_SETTING",
    "S3_BUCKET",
)
SECRET_VALUES = (
    "Bearer abcdef0123456789xyz",
    "bearer eyJhbGciOi.something-long",
    "sk-abcdefghijklmnop1234567890",
    "sk-proj-AbCdEf0123456789_ghijkl",
    "sk-ant-api03-AbCdEf0123456789ghij",
    "sk_live_0123456789abcdefABCD",
    "ghp_0123456789abcdefghijABCDEFGHIJ0123",
    "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz",
    "glpat-abcdefghij0123456789",
    "hf_abcdefghijklmnopqrstuvwxyzABCDEFGH",
    "xoxb-123456789012-abcdefghijkl",
    "AKIAABCDEFGHIJKLMNOP",
    "AIzaSyA0123456789abcdefghijklmnopqrstu",
    "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    "postgres://admin:hunter2@db.example.com:5432/prod",
    "https://user:pa55@example.com/path",
    "redis://:onlypassword@cache:6379/0",
    "https://hooks.slack.com/services/T000/B000/XXXXXXXX",
    "https://discord.com/api/webhooks/123/abc",
    "https://example.com/hook?token=abcdef123456",
    "0123456789abcdef0123456789abcdef",
    "3f786850e387550fdab836ed7e6dc881de23001b3f786850",
    "dGhpcyBpcyBhIHNlY3JldCBrZXkgdmFsdWUgMTIzNDU2Nzg5MA==",
    "-----BEGIN RSA PRIVATE KEY-----\nMIIEow...",
)
PLAIN_VALUES = (
    "Qwen/Qwen2.5-0.5B-Instruct",
    "embedded-tiny",
    "runs",
    "/work/data/train.jsonl",
    "arithmetic",
    "https://example.com/data.jsonl",
    "http://127.0.0.1:8080",
    "grpo",
    "offline",
    "The answer is 42.",
    "token_mean",
    "sk-short",
    "cafe",
    "step-00012",
    "bfloat16",
    "ray://head:10001",
)


def test_environment_variables_are_redacted_unless_kept_in_clear():
    env_vars = {name: f"value-of-{name.lower()}" for name in SECRET_ENV_NAMES}
    env_vars |= {
        "PYTHONPATH": "/opt/code",
        "OMP_NUM_THREADS": "4",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HOME": "/cache/hf",
        "MY_SETTING": "fast",
    }
    tree = {"ray": {"runtime_env": {"env_vars": env_vars, "working_dir": "."}, "env_vars_in_clear": ["MY_SETTING"]}}
    saved = redact_secrets(tree)["ray"]
    assert {name for name, value in saved["runtime_env"]["env_vars"].items() if value == REDACTED} == set(
        SECRET_ENV_NAMES
    )
    for name in (
        "PYTHONPATH",
        "OMP_NUM_THREADS",
        "CUDA_VISIBLE_DEVICES",
        "TOKENIZERS_PARALLELISM",
        "HF_HOME",
        "MY_SETTING",
    ):
        assert saved["runtime_env"]["env_vars"][name] == env_vars[name], name
    assert saved["runtime_env"]["working_dir"] == "." and saved["env_vars_in_clear"] == ["MY_SETTING"]
    assert {
        "PYTHONPATH",
        "OMP_NUM_THREADS",
        "CUDA_VISIBLE_DEVICES",
        "TOKENIZERS_PARALLELISM",
        "HF_HOME",
    } <= CLEAR_ENV_VARS
    # a settings name in clear still has a credential-looking value redacted
    leaked = redact_secrets({"ray": {"runtime_env": {"env_vars": {"HF_HOME": "sk-abcdefghijklmnop1234567890"}}}})
    assert leaked["ray"]["runtime_env"]["env_vars"]["HF_HOME"] == REDACTED


@pytest.mark.parametrize("value", SECRET_VALUES)
def test_a_credential_is_redacted_by_its_form_under_any_key(value):
    assert looks_like_secret(value)
    tree = {"task": {"options": {"source": value, "sources": [value, "plain"]}}, "model": {"name": value}}
    assert redact_secrets(tree) == {
        "task": {"options": {"source": REDACTED, "sources": [REDACTED, "plain"]}},
        "model": {"name": REDACTED},
    }


@pytest.mark.parametrize("value", PLAIN_VALUES)
def test_ordinary_text_is_not_taken_for_a_credential(value):
    assert not looks_like_secret(value)
    assert redact_secrets({"task": {"options": {"source": value}}}) == {"task": {"options": {"source": value}}}


def test_secret_names_of_every_common_form_are_redacted():
    names = (
        "OPENAI_API_KEY",
        "MY_KEY",
        "GITHUB_PAT",
        "session_cookie",
        "Authorization",
        "db_password",
        "slack_webhook",
        "sentry_dsn",
        "bearer",
        "client_secret",
    )
    tree = {"task": {"options": {name: "plain-looking" for name in names} | {"answer_key": "A", "keep": "x"}}}
    options = redact_secrets(tree)["task"]["options"]
    assert [name for name in names if options[name] != REDACTED] == []
    assert options["answer_key"] == "A" and options["keep"] == "x"


def test_a_resumed_run_reads_redacted_environment_variables_again(tmp_path, monkeypatch):
    overrides = [
        "task.name=arithmetic",
        "log.monitor=false",
        "ray.runtime_env={env_vars: {MY_KEY: k-1, SOME_SETTING: s-1, OMP_NUM_THREADS: '2'}}",
        "task.options={digits: 1, source_url: 'https://u:secretpw@example.com/x'}",
    ]
    logger = MetricsLogger(tmp_path / "run", tensorboard=False)
    logger.write_config(load_config(None, overrides).to_dict())
    logger.close()
    saved = tmp_path / "run" / "config.yaml"
    text = saved.read_text(encoding="utf-8")
    assert "k-1" not in text and "s-1" not in text and "secretpw" not in text and "OMP_NUM_THREADS: '2'" in text
    for name in ("MY_KEY", "SOME_SETTING", "source_url", "SOURCE_URL"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="env_vars.MY_KEY, ray.runtime_env.env_vars.SOME_SETTING"):
        load_config(saved, ["task.options.source_url=https://u:secretpw@example.com/x"])
    monkeypatch.setenv("MY_KEY", "k-2")
    config = load_config(
        saved, ["ray.runtime_env.env_vars.SOME_SETTING=s-2", "task.options.source_url=https://u:pw2@example.com/x"]
    )
    assert config.ray.runtime_env["env_vars"] == {"MY_KEY": "k-2", "SOME_SETTING": "s-2", "OMP_NUM_THREADS": "2"}
    assert config.task.options["source_url"] == "https://u:pw2@example.com/x"


MCP_SECRET = "plain-value-7f3a9c"  # looks like nothing: only its place says it is an environment variable's


def test_every_environment_mapping_is_redacted_in_config_yaml_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    server = {"command": "python", "args": ["server.py"], "env": {"SEARCH_BACKEND": MCP_SECRET, "LANG": "C.UTF-8"}}
    overrides = [
        "task.name=arithmetic",
        "log.monitor=false",
        f"task.tools=[{{name: mcp, server: {json.dumps(server)}}}]",
    ]
    logger = MetricsLogger(tmp_path / "run", tensorboard=True)
    logger.write_config(load_config(None, overrides).to_dict())
    logger.close()
    files = [path for path in (tmp_path / "run").rglob("*") if path.is_file()]
    assert any("tensorboard" in path.parts for path in files)
    for path in files:
        assert MCP_SECRET.encode() not in path.read_bytes(), path
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text(encoding="utf-8"))
    assert saved["task"]["tools"][0]["server"]["env"] == {"SEARCH_BACKEND": REDACTED, "LANG": "C.UTF-8"}
    assert saved["task"]["tools"][0]["server"]["command"] == "python" and saved["env"]["id"] == "CartPole-v1"


def test_environment_variables_are_redacted_at_any_depth_in_mappings_and_lists():
    tree = {
        "my_plugin": {"backends": [{"environment": {"REGION_NAME": "eu-1", "HF_HOME": "/cache"}}]},
        "task": {
            "env": "tool",  # a setting, not a mapping of variables
            "env_options": {"sandbox": {"env": ["ENDPOINT_ID=abc123", "TZ=UTC", "plain entry"]}},
            "rewards": [{"name": "judge", "options": {"env_vars": {"JUDGE_ROUTE": "internal-7"}}}],
        },
        "env": {"id": "CartPole-v1"},  # the gymnasium section
    }
    saved = redact_secrets(tree)
    assert saved["my_plugin"]["backends"][0]["environment"] == {"REGION_NAME": REDACTED, "HF_HOME": "/cache"}
    assert saved["task"]["env"] == "tool" and saved["env"] == {"id": "CartPole-v1"}
    assert saved["task"]["env_options"]["sandbox"]["env"] == [REDACTED, "TZ=UTC", REDACTED]
    assert saved["task"]["rewards"][0]["options"]["env_vars"] == {"JUDGE_ROUTE": REDACTED}
