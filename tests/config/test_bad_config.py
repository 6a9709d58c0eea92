"""Bad configurations: each is rejected by ``load_config`` or the CLI with a message that names the problem and
the fix, never a traceback from yaml or pydantic, and nothing is written for a rejected run."""

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from unipg.cli import app
from unipg.config import ConfigError, load_config

runner = CliRunner()
TEXT = ["task.name=arithmetic"]


def write(tmp_path: Path, content: bytes | str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


def problem(overrides: list[str], path: Path | None = None) -> str:
    with pytest.raises(ConfigError) as error:
        load_config(path, overrides)
    return str(error.value)


# --- malformed files ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, expected",
    [
        ("train:\n\tlearning_rate: 1e-3\n", r"line 2, column 1: found character '\\t'.*indent with spaces"),
        ("algorithm: [ppo\n", r"flow sequence that starts on line 1, column 12\); close the bracket"),
        ("train: {batch_size: 64\n", r"flow mapping that starts on line 1, column 8\); close the bracket"),
        ("algorithm: ppo\nalgorithm: a2c\n", r"key 'algorithm' is set twice \(lines 1 and 2\); keep one of them"),
        ("a: *missing\n", r"line 1, column 4: found undefined alias 'missing'"),
        ("seed: !!int seven\n", r"holds a value YAML cannot build .*quote the value or remove its explicit !!tag"),
    ],
)
def test_malformed_yaml_says_where_and_how_to_fix(tmp_path, content, expected):
    message = problem([], write(tmp_path, content))
    assert "is not valid YAML" in message or "cannot build" in message
    assert "\n" not in message  # one line, not the parser's multi-line excerpt
    assert re.search(expected, message), message


@pytest.mark.parametrize(
    "content, expected",
    [
        ("- algorithm: ppo\n- seed: 1\n", "must hold a mapping of keys to values (key: value lines), got a list"),
        ("just text\n", "must hold a mapping of keys to values (key: value lines), got a str"),
        (b"algorithm: ppo\nenv:\n  id: caf\xe9\n", "is not UTF-8 text (byte 0xe9 on line 3); save it as UTF-8"),
        ("algorithm: ppo\x00\n", "unacceptable character #x0000"),
        ("train: [64, 32]\n", "'train' is a section; give it a mapping such as train: {...}"),
    ],
)
def test_files_that_are_not_a_mapping_of_settings(tmp_path, content, expected):
    assert expected in problem([], write(tmp_path, content))


@pytest.mark.parametrize("content", ["", "# every key commented out\n"])
def test_a_file_without_settings_trains_with_the_defaults_and_says_so(tmp_path, content):
    with pytest.warns(UserWarning, match="holds no settings; training with the defaults"):
        assert load_config(write(tmp_path, content)) == load_config(None)


def test_a_run_name_may_hold_folders_inside_the_output_folder(tmp_path):
    assert load_config(None, ["log.run_name=sweep1/lr3e-4"]).log.run_name == "sweep1/lr3e-4"


def test_a_missing_path_and_a_folder_are_told_apart(tmp_path):
    assert "does not exist; pass the path of a YAML file" in problem([], tmp_path / "missing.yaml")
    assert "is a folder; pass the path of a YAML file" in problem([], tmp_path)
    write(tmp_path, "algorithm: ppo\n")  # a run folder: point at its config.yaml
    assert f"such as '{tmp_path / 'config.yaml'}'" in problem([], tmp_path)


def test_a_yaml_alias_inside_its_own_value_is_rejected(tmp_path):
    assert "holds a YAML alias inside the value it names" in problem([], write(tmp_path, "task: &t {options: *t}\n"))
    assert "write the value out" in problem(["task.options=&x {a: *x}"])
    shared = load_config(write(tmp_path, "task:\n  name: arithmetic\n  options: {digits: &d 2}\nseed: *d\n"))
    assert shared.seed == 2 and shared.task.options == {"digits": 2}  # an ordinary alias is fine


def test_a_utf8_byte_order_mark_is_accepted(tmp_path):
    assert load_config(write(tmp_path, b"\xef\xbb\xbfalgorithm: a2c\n")).algorithm == "a2c"


# --- wrong types and out-of-range values ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.batch_size=abc", "'train.batch_size': Input should be a valid integer"),
        ("train.batch_size=1.5", "'train.batch_size': Input should be a valid integer, got a number with a fractional"),
        ("train.learning_rate=[0.1]", "'train.learning_rate': Input should be a valid number (got [0.1])"),
        ("train.batch_size=true", "'train.batch_size': expected a number, not a boolean (got True)"),
        ("seed=yes", "'seed': expected a number, not a boolean (got True)"),
        ("estimator.normalize_advantages=maybe", "'estimator.normalize_advantages': Input should be a valid boolean"),
        ("train.learning_rate=-1e-3", "'train.learning_rate': Input should be greater than 0 (got '-1e-3')"),
        ("train.learning_rate=.inf", "'train.learning_rate': Input should be a finite number (got inf)"),
        ("estimator.kl_coef=nan", "'estimator.kl_coef': Input should be a finite number (got 'nan')"),
        ("estimator.clip_range=0", "'estimator.clip_range': Input should be greater than 0 (got 0)"),
        ("estimator.clip_range=-0.2", "'estimator.clip_range': Input should be greater than 0"),
        ("estimator.gamma=1.01", "'estimator.gamma': Input should be less than or equal to 1"),
        ("estimator.lambda_gae=-0.5", "'estimator.lambda_gae': Input should be greater than or equal to 0"),
        ("train.batch_size=0", "'train.batch_size': Input should be greater than or equal to 1 (got 0)"),
        ("train.mini_batch_size=0", "'train.mini_batch_size': Input should be greater than or equal to 1"),
        ("seed=-1", "'seed': Input should be greater than or equal to 0"),
        ("seed=99999999999", "'seed': Input should be less than 2147483648"),
        ("sample.stop=</s>", "'sample.stop': Input should be a valid list (got '</s>')"),
        ("sample.stop=['']", "'sample.stop': stop strings must not be empty: an empty string matches everywhere"),
        ("sample.stop=['</s>', '']", "ends every completion after one token; remove it"),
        ("log.run_name=../elsewhere", "'log.run_name': run_name must be a relative folder path"),
        ("log.run_name=/tmp/x", "without '..', '.' or empty parts; the folder is made under log.output_dir"),
        ("log.run_name=sweep/../../x", "run_name must be a relative folder path"),
    ],
)
def test_wrong_types_and_ranges_name_the_key_and_the_value(override, expected):
    assert expected in problem([override])


def test_yaml_booleans_and_dates_in_text_fields_say_to_quote(tmp_path):
    message = problem([], write(tmp_path, "log:\n  run_name: 2024-01-01\nenv:\n  id: no\n"))
    assert "'log.run_name': expected text" in message and "'env.id': expected text" in message
    assert "quote the value" in message


def test_text_field_overrides_keep_the_text_as_written():
    config = load_config(None, ["log.run_name=2024-01-01", "env.id=no", "task.name=null"])
    assert config.log.run_name == "2024-01-01" and config.env.id == "no" and config.task.name is None


# --- contradictions -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["train.mini_batch_transitions=100"],
            "train.mini_batch_transitions (100) must divide train.batch_transitions (256)",
        ),
        ([*TEXT, "sample.samples_per_prompt=3"], "sample.samples_per_prompt (3) must divide train.batch_size (64)"),
        ([*TEXT, "algorithm=grpo", "sample.samples_per_prompt=1"], "set sample.samples_per_prompt to at least 2"),
        (
            [*TEXT, "algorithm=remax", "data.offline.path=episodes.jsonl"],
            "not for the recorded episodes of data.offline; unset data.offline",
        ),
        (
            [*TEXT, "algorithm=remax", "sample.dynamic_sampling=true"],
            "such a group still has a gradient; set sample.dynamic_sampling=false",
        ),
        ([*TEXT, "algorithm=remax", "sample.temperature=0"], "is 0 for all of them; sample at a temperature > 0"),
        ([*TEXT, "train.micro_batch_size=24"], "train.micro_batch_size (24) must divide train.mini_batch_size (32)"),
        (
            [*TEXT, "sample.replay_buffer_size=1"],
            "sample.replay_buffer_size (1) cannot hold one learner step's batch of 64 trajectories",
        ),
        ([*TEXT, "algorithm=ppo", "model.value_head=false"], "needs a critic; set model.value_head=true"),
        (
            [*TEXT, "runtime.max_staleness=2", "runtime.partial_rollouts=true"],
            "next turn: set sample.engine=vllm, or runtime.partial_rollouts=false",
        ),
        (
            [*TEXT, "sample.engine=vllm", "runtime.partial_rollouts=true"],
            "while episodes run: set runtime.max_staleness > 0, or runtime.partial_rollouts=false",
        ),
        (["env.total_steps=100"], "train.batch_transitions (256) exceeds env.total_steps (100)"),
        (["estimator.clip_range_high=0.1"], "clip-higher needs ε_high ≥ ε_low"),
        (["estimator.kl_control=adaptive"], "set target_kl (e.g. 0.02)"),
        (["learning_rate=1e-3", "train.learning_rate=1e-4"], "keep one of them"),
        (["algorithm=grpo"], "trains language models on text tasks; set task.name"),
    ],
)
def test_contradictions_say_how_to_fix(overrides, expected):
    assert expected in problem(overrides)


def test_remax_samples_one_completion_per_prompt():
    config = load_config(None, [*TEXT, "algorithm=remax"])  # its baseline is the greedy response, not the group
    assert config.sample.samples_per_prompt == 1 and config.prompts_per_step == config.train.batch_size


def test_an_output_dir_that_is_a_file_is_rejected(tmp_path):
    file = write(tmp_path, "not a folder", name="runs")
    assert f"log.output_dir '{file}' is a file; point it at a folder" in problem([f"log.output_dir={file}"])


def test_algorithm_must_be_a_name(tmp_path):
    assert "algorithm must be the name of a preset, got [1]" in problem([], write(tmp_path, "algorithm: [1]\n"))
    assert "unknown algorithm 'ppp'; did you mean 'ppo'?" in problem(["algorithm=ppp"])
    assert "unknown algorithm 'zzz'. Valid: a2c" in problem(["algorithm=zzz"])


# --- unknown keys and malformed overrides ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, expected",
    [
        ("estimator.clip_rnge=0.1", "unknown key 'estimator.clip_rnge'; did you mean 'estimator.clip_range'?"),
        ("lerning_rate=0.1", "unknown key 'lerning_rate'; did you mean 'learning_rate'?"),
        ("train.zzzzzz=1", "unknown key 'train.zzzzzz'; section 'train' has adam_eps, batch_size"),
        ("zzz.key=1", "unknown key 'zzz'; valid top-level keys: agent, algorithm"),
        ("train=3", "'train' is a section; give it a mapping"),
        ("train.batch_size=[1, 2]", "'train.batch_size': Input should be a valid integer (got [1, 2])"),
    ],
)
def test_unknown_keys_and_wrong_values_in_overrides(override, expected):
    assert expected in problem([override])


@pytest.mark.parametrize(
    "override, expected",
    [
        ("estimator.clip_range", "must look like key=value, e.g. estimator.clip_range=0.1"),
        ("=0.1", "must look like key=value"),
        ("", "must look like key=value"),
        ("train..batch_size=3", "has an empty part in its key 'train..batch_size'; write section.name=value"),
        (".seed=3", "has an empty part in its key"),
        ("train.=3", "has an empty part in its key"),
    ],
)
def test_malformed_overrides(override, expected):
    assert expected in problem([override])


# --- the command line -----------------------------------------------------------------------------------------


def cli_error(args: list[str], tmp_path: Path) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and result.output.count("\n") == 1  # one line, no traceback
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert not [path for path in tmp_path.iterdir() if path.is_dir()], "a rejected run must write nothing"
    return " ".join(result.output.split())


@pytest.mark.parametrize(
    "args, expected",
    [
        (["a.b"], "override 'a.b' must look like key=value"),
        (["=value"], "override '=value' must look like key=value"),
        (["nosuch.key=1"], "unknown key 'nosuch'"),
        (["train.batch_size=many"], "'train.batch_size': Input should be a valid integer"),
        (["x[/y]=1"], "unknown key 'x[/y]'"),  # brackets are printed, not read as markup
        (["algorithm=[1]"], "unknown algorithm '[1]'"),
        (["--seeds", "0,x"], "--seeds takes comma-separated integers such as 0,1,2, got '0,x'"),
        (["--seeds", "[/x]"], "got '[/x]'"),
        (["--seeds", "1,2,1"], "--seeds lists seed 1 more than once"),
        (["--seeds", "0,1", "seed=3"], "the seed is set twice, by --seeds and by a seed= override"),
        (["--config", "MISSING"], "does not exist; pass the path of a YAML file"),
    ],
)
def test_cli_prints_one_error_line_and_exits_2(tmp_path, args, expected):
    args = [arg.replace("MISSING", str(tmp_path / "missing.yaml")) for arg in args]
    assert expected in cli_error(["train", *args, f"log.output_dir={tmp_path}"], tmp_path)


def test_cli_yaml_error_is_one_line(tmp_path):
    config = write(tmp_path, "train:\n\tbatch_size: 64\n", name="tabs.yaml")
    result = runner.invoke(app, ["train", "--config", str(config), f"log.output_dir={tmp_path}"])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "indent with spaces" in result.output


def test_a_rejected_run_leaves_an_earlier_run_untouched(tmp_path):
    earlier = tmp_path / "baseline"
    (earlier / "checkpoints").mkdir(parents=True)
    files = {"metrics.jsonl": '{"step": 1}\n', "config.yaml": "algorithm: ppo\n", "checkpoints/step-1.pt": "x"}
    for name, text in files.items():
        (earlier / name).write_text(text)
    result = runner.invoke(app, ["train", f"log.output_dir={tmp_path}", "log.run_name=baseline", "env.total_steps=256"])
    assert result.exit_code == 2 and "already holds a run; choose another log.run_name" in result.output
    result = runner.invoke(app, ["train", f"log.output_dir={earlier}", "log.run_name=..", "env.total_steps=256"])
    assert result.exit_code == 2 and "run_name must be a relative folder path" in result.output
    assert {name: (earlier / name).read_text() for name in files} == files
    assert sorted(path.name for path in tmp_path.iterdir()) == ["baseline"]
