"""Plugins: user code in a module, a file, an --import option or an entry point registers tasks, tools and rewards
that a config can then name, without a wrapper script."""

from __future__ import annotations

import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

import unipg
from tests.helpers.plugins import FAST, write_plugin
from unipg.cli import app
from unipg.config import ConfigError, load_config
from unipg.config import plugins as plugin_module
from unipg.observe.metrics import read_metrics
from unipg.registry import Registry
from unipg.tasks.base import TASKS
from unipg.tasks.rewards.rules import REWARDS
from unipg.tools.base import TOOLS


@pytest.fixture
def registries(monkeypatch):
    """Registrations made by a test's plugins are undone after it, and so are the modules it imported."""
    for registry in (TASKS, TOOLS, REWARDS):
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))
    yield
    for name in [name for name in sys.modules if name.startswith(PLUGIN_MODULES)]:
        del sys.modules[name]


PLUGIN_MODULES = ("unipg_plugin_", "letters_plugin", "entry_plugin_")


@pytest.mark.e2e
def test_a_plugin_file_listed_in_the_config_trains_from_the_command_line(registries, embedded_path, tmp_path):
    """`unipg train --config my.yaml` where my.yaml lists a file (relative to itself) holding a task, its tool and
    its reward: the run trains with them, and its saved config names the plugin by its absolute path."""
    project = tmp_path / "project"
    project.mkdir()
    write_plugin(project, "cli")
    config_file = project / "my.yaml"
    config_file.write_text(yaml.safe_dump({"plugins": ["./my_task.py"], "task": {"name": "letter_count_cli"}}))
    result = CliRunner().invoke(
        app,
        [
            "train",
            "--config",
            str(config_file),
            *FAST,
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path / 'runs'}",
        ],
    )
    assert result.exit_code == 0, result.output
    run_dir = next((tmp_path / "runs").iterdir())
    steps = [record for record in read_metrics(run_dir) if "train/loss" in record]
    assert [record["step"] for record in steps] == [1, 2]
    assert "rollout/reward_same_count_cli" in steps[0] and "rollout/tool_calls" in steps[0]
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["plugins"] == [str((project / "my_task.py").resolve())]


@pytest.mark.e2e
def test_import_option_and_the_api_load_a_module_plugin(registries, embedded_path, tmp_path, monkeypatch):
    """`unipg --import MODULE` imports a module from sys.path before the config is checked; `unipg.train` takes
    the same module as `plugins=` and trains on it."""
    write_plugin(tmp_path, "mod", "letters_plugin.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    shown = CliRunner().invoke(app, ["--import", "letters_plugin", "config", "task.name=letter_count_mod"])
    assert shown.exit_code == 0, shown.output
    assert "letters_plugin" in shown.output
    result = unipg.train(
        None,
        plugins=["letters_plugin"],
        overrides=[
            "task.name=letter_count_mod",
            *FAST,
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path / 'runs'}",
        ],
    )
    assert result.config.plugins == ["letters_plugin"]
    assert 0.0 <= result.metrics["rollout/reward_same_count_mod"] <= 1.0


def test_without_the_plugin_the_task_is_unknown(registries):
    with pytest.raises(ConfigError, match="unknown task 'letter_count_none'"):
        unipg.load_config(None, overrides=["task.name=letter_count_none"])


def test_a_plugin_that_fails_to_import_names_itself_and_its_error(registries, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('cannot reach the data server')\n")
    with pytest.raises(ConfigError) as raised:
        load_config(None, [f"plugins=[{broken}]"])
    assert str(raised.value) == (f"plugin file '{broken}' failed to import: RuntimeError: cannot reach the data server")
    with pytest.raises(
        ConfigError,
        match=r"plugin 'no_such_plugin_module' failed to import: ModuleNotFoundError: "
        r".*; is it installed, or on PYTHONPATH\?",
    ):
        load_config(None, ["plugins=[no_such_plugin_module]"])
    with pytest.raises(ConfigError, match="plugin file '.*missing.py' does not exist"):
        load_config(None, [f"plugins=[{tmp_path / 'missing.py'}]"])
    with pytest.raises(ConfigError, match="plugins must be a list of module names or Python file paths"):
        load_config(None, ["plugins=[3]"])
    with pytest.raises(ConfigError, match="plugins: 'my tasks' is neither a module name"):
        load_config(None, ["plugins=[my tasks]"])
    result = CliRunner().invoke(app, ["--import", str(broken), "algorithms"])
    assert result.exit_code == 2 and "failed to import: RuntimeError: cannot reach the data server" in result.output


@pytest.mark.parametrize("code", ["0", "None", "'done'"])
def test_a_plugin_that_calls_sys_exit_at_import_is_a_failed_import_not_a_silent_success(registries, tmp_path, code):
    exiting = tmp_path / f"exiting_{len(code)}.py"
    exiting.write_text(f"import sys\nsys.exit({code})\n")
    with pytest.raises(ConfigError, match=r"called sys\.exit\(.*\) while it was imported.*__main__"):
        load_config(None, [f"plugins=[{exiting}]"])
    result = CliRunner().invoke(app, ["train", f"plugins=[{exiting}]", "task.name=arithmetic"])
    assert result.exit_code == 2 and "sys.exit" in result.output
    result = CliRunner().invoke(app, ["--import", str(exiting), "algorithms"])
    assert result.exit_code == 2 and "sys.exit" in result.output


def test_a_plugin_reward_that_calls_sys_exit_during_the_run_is_an_error_naming_its_line(
    registries, embedded_path, tmp_path
):
    exiting = tmp_path / "exiting_reward.py"
    exiting.write_text(
        "import sys\nfrom unipg.tasks.rewards.rules import REWARDS\n\n\n@REWARDS.register('exiting_reward')\n"
        "def exiting_reward():\n    def reward(prompts, completions, **columns):\n        sys.exit(0)\n"
        "    return reward\n"
    )
    result = CliRunner().invoke(
        app,
        [
            "--import",
            str(exiting),
            "train",
            "task.name=arithmetic",
            "task.rewards=[{name: exiting_reward}]",
            *FAST,
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path / 'runs'}",
        ],
    )
    assert result.exit_code == 2, result.output
    assert f"sys.exit(0) at {exiting}:8" in " ".join(result.output.split())


def test_a_file_plugin_is_imported_once_whoever_asks(registries, tmp_path):
    """Loading two configs that name one file does not register its task twice (which the registry refuses)."""
    path = write_plugin(tmp_path, "once")
    first = load_config(None, [f"plugins=[{path}]", "task.name=letter_count_once"])
    second = load_config(None, [f"plugins=[{path}]", "task.name=letter_count_once"])
    assert first.plugins == second.plugins == [str(path)]
    assert plugin_module.file_module_name(path) in sys.modules


def test_entry_point_plugins_are_loaded_once(registries, tmp_path, monkeypatch):
    """An installed package registers through the `unipg.plugins` entry-point group: a module, or a function
    called with no arguments."""
    calls = []
    estimators = Registry("estimator")
    module = tmp_path / "entry_plugin_module.py"
    module.write_text("from unipg.tasks.base import TASKS\nTASKS.register('entry_point_task')(lambda: None)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules["entry_plugin_hook"] = type(sys)("entry_plugin_hook")
    sys.modules["entry_plugin_hook"].register = lambda: calls.append(estimators.register("mine")(len))
    entries = [
        EntryPoint("tasks", "entry_plugin_module", plugin_module.ENTRY_POINT_GROUP),
        EntryPoint("hook", "entry_plugin_hook:register", plugin_module.ENTRY_POINT_GROUP),
    ]
    monkeypatch.setattr(plugin_module, "entry_points", lambda group: entries if group == "unipg.plugins" else [])
    plugin_module.load_entry_point_plugins.cache_clear()
    try:
        assert unipg.load_config(None, overrides=["task.name=entry_point_task"]).task.name == "entry_point_task"
        plugin_module.import_plugins([])
        assert "entry_point_task" in TASKS and "mine" in estimators and len(calls) == 1
    finally:
        plugin_module.load_entry_point_plugins.cache_clear()


def test_a_payload_from_a_plugin_file_unpickles_in_a_fresh_process(registries, tmp_path):
    """What the Ray backend sends its actors: a task and tool defined in a plugin file, wrapped so that the
    receiving process imports the plugin before it looks them up."""
    import pickle
    import subprocess

    from unipg.tasks.base import make_task
    from unipg.tools.base import TOOLS

    path = write_plugin(tmp_path, "pickle")
    plugin_module.import_plugins([str(path)])
    payload = (make_task("letter_count_pickle", num_train=2, num_test=1), TOOLS.get("letters_pickle")())
    wrapped, unwrapped = tmp_path / "wrapped.pickle", tmp_path / "unwrapped.pickle"
    wrapped.write_bytes(pickle.dumps(plugin_module.imported_first([str(path)], payload)))
    unwrapped.write_bytes(pickle.dumps(payload))
    script = (
        "import pickle, sys\n"
        "try:\n    pickle.loads(open(sys.argv[2], 'rb').read())\n"
        "except ModuleNotFoundError:\n    print('unwrapped: unknown module')\n"
        "task, tool = pickle.loads(open(sys.argv[1], 'rb').read())\n"
        "print(task.name, tool.function('abc'))\n"
    )
    shown = subprocess.run(
        [sys.executable, "-c", script, str(wrapped), str(unwrapped)], capture_output=True, text=True, timeout=120
    )
    assert shown.stdout.split("\n")[:2] == ["unwrapped: unknown module", "letter_count_pickle 3"], shown.stderr[-2000:]


def test_the_example_plugin_task_loads_and_its_demonstrations_earn_full_reward(registries):
    from unipg.tasks.base import make_task
    from unipg.tasks.rewards.rules import build_rewards

    example_config = Path(__file__).resolve().parents[2] / "examples" / "plugin_task" / "config.yaml"
    config = unipg.load_config(example_config, train__updates=1)
    assert config.plugins == [str(example_config.parent / "letter_count.py")] and not config.warnings
    task = make_task(config.task.name, **config.task.options)
    example = task.train[0]
    demonstrated = example.solution[-1]["content"]
    scored = build_rewards(task.rewards)(
        [example.prompt], [demonstrated], **{name: [value] for name, value in example.columns.items()}
    )
    assert scored.total == [1.0]
    assert TOOLS.get("letters")().function(example.prompt.split()[-1].rstrip("?")) == example.answer
