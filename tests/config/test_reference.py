"""The configuration reference: ``unipg config --explain`` and docs/config.md, both read from the schema."""

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from unipg.cli import app
from unipg.config import ConfigError
from unipg.config.explain import explain
from unipg.config.reference import REGENERATE, sections

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def keys() -> dict:
    return {doc.key: doc for section in sections() for doc in section.keys}


def test_every_key_has_its_docstring_as_help_and_a_type_and_default():
    documented = keys()
    assert {"estimator.clip_range", "sample.top_p", "sft.stages[].steps", "data.offline.path"} <= set(documented)
    assert [key for key, doc in documented.items() if not (doc.help and doc.type and doc.default)] == []
    clip = documented["estimator.clip_range"]
    assert (clip.type, clip.default) == ("float (> 0.0, < 1.0)", "0.2")
    assert clip.help.startswith("PPO ε")
    assert clip.condition.startswith("only when estimator.policy_loss is") and "ppo" in clip.condition


def test_the_reference_says_which_modes_read_each_key():
    documented = keys()
    assert documented["device"].modes == ("lm",)
    assert documented["env.id"].modes == ("gym",)
    assert documented["task.options"].modes == ("lm",)  # the section's declaration covers its keys
    assert documented["train.learning_rate"].modes == ("gym", "lm")
    assert documented["sample.rollout_steps"].modes == ()
    assert "trpo" in documented["train.num_epochs"].ignored_by


def test_explain_a_key_prints_its_name_type_default_help_and_modes():
    text = explain(["estimator.clip_range"])
    assert text.splitlines()[0] == "estimator.clip_range  float (> 0.0, < 1.0)"
    for part in ("PPO ε", "default:    0.2", "read in:    gym and lm runs", "presets:"):
        assert part in text
    assert "read in:    lm runs" in explain(["device"])


def test_explain_a_section_lists_every_key_of_it_and_nothing_lists_every_section():
    text = explain(["sample"])
    assert text.startswith("[sample] How completions are sampled")
    assert all(f"\n{key}  " in text for key in keys() if key.startswith("sample."))
    everything = explain([])
    assert all(f"[{section.name}]" in everything for section in sections() if section.name)


def test_explain_reads_flat_aliases_and_nested_keys_written_plainly():
    assert explain(["clip_range"]).startswith("'clip_range' is the flat name of estimator.clip_range\n")
    assert explain(["sft.stages.steps"]).startswith("sft.stages[].steps  int")
    assert "data.offline.mix.start" in explain(["data.offline"])


def test_an_unknown_key_or_section_names_the_nearest():
    with pytest.raises(
        ConfigError,
        match=r"unknown key or section 'estimator.clip_rnge'; did you mean "
        r"'estimator.clip_range'\?",
    ):
        explain(["estimator.clip_rnge"])
    with pytest.raises(ConfigError, match=r"did you mean 'estimator.clip_range'"):
        explain(["train.clip_range"])  # the right key in the wrong section
    with pytest.raises(ConfigError, match=r"did you mean 'sample'"):
        explain(["sampel"])


def test_the_command_explains_and_exits_2_without_a_traceback_on_an_unknown_key():
    shown = runner.invoke(app, ["config", "--explain", "estimator.clip_range"])
    assert shown.exit_code == 0 and shown.output.startswith("estimator.clip_range  float")
    unknown = runner.invoke(app, ["config", "--explain", "estimator.clip_rnge"])
    assert unknown.exit_code == 2 and "did you mean 'estimator.clip_range'" in unknown.output
    assert "Traceback" not in unknown.output
    values = runner.invoke(app, ["config", "algorithm=trpo"])
    assert values.exit_code == 0 and "policy_loss: trpo" in values.output


def test_docs_config_md_is_the_reference_the_schema_generates():
    # a fresh interpreter: plugins registered by other tests must not change what the command prints
    generated = subprocess.run(
        [sys.executable, "-m", "unipg.config.reference"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    committed = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert committed == generated, f"docs/config.md differs from the schema; regenerate it: {REGENERATE}"
