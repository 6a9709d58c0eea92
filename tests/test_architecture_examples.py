"""Every Python example of docs/architecture.md runs as written.

Each fenced ``python`` block is written to a file and loaded through the config's ``plugins``, as a user's plugin
is; what it registers is then used the way a run uses it: the task and reward build, the tool is called under its
registered name, the tool-call format and the environment drive a tool or guessing episode, and the estimator, the
policy loss, the engine and the backend train one update of a tiny language-model run."""

from __future__ import annotations

import asyncio
import math
import re
import sys
from pathlib import Path

import pytest

import unipg
from unipg.config import ConfigError
from unipg.envs import ENVS, EnvironmentService
from unipg.envs.service import build_tools
from unipg.estimate import ADVANTAGES, POLICY_LOSSES, advantage_family
from unipg.inference import ENGINES
from unipg.policy.tool_calls import rewrite_calls
from unipg.runtime import BACKENDS
from unipg.sample.episodes import EpisodeRunner
from unipg.tasks import REWARDS, TASKS, build_rewards, make_task
from unipg.tools import TOOL_PARSERS, TOOLS, format_tool_call

DOC = Path(__file__).parents[1] / "docs" / "architecture.md"
REGISTRIES = (TASKS, REWARDS, TOOLS, TOOL_PARSERS, ENVS, ADVANTAGES, POLICY_LOSSES, ENGINES, BACKENDS)
TINY = [
    "algorithm=grpo",
    "task.name=arithmetic",
    "task.options={digits: 1, num_train: 16, num_test: 4}",
    "train.batch_size=8",
    "train.mini_batch_size=8",
    "train.micro_batch_size=8",
    "sample.samples_per_prompt=4",
    "sample.max_new_tokens=4",
    "train.updates=1",
    "eval.every_updates=100",
    "eval.pass_k=0",
    "eval.max_examples=4",
    "log.progress=false",
    "log.tensorboard=false",
    "checkpoint.every_updates=0",
]


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", DOC.read_text(encoding="utf-8"), flags=re.S | re.M)


class Examples:
    """The doc's blocks loaded as plugins: their files, modules, and what each registered in which registry."""

    def __init__(self, folder: Path):
        self.plugins, self.added = [], {}
        for index, code in enumerate(python_blocks()):
            path = folder / f"architecture_example_{index}.py"
            path.write_text(code, encoding="utf-8")
            before = {registry: set(registry.names()) for registry in REGISTRIES}
            unipg.load_config(None, plugins=[str(path)])  # imports the plugin, as a run's config does
            self.plugins.append(str(path))
            self.added[str(path)] = {
                registry: sorted(set(registry.names()) - before[registry])
                for registry in REGISTRIES
                if set(registry.names()) - before[registry]
            }

    def name(self, registry) -> str:
        """The one name the doc's examples registered in ``registry``."""
        names = [name for added in self.added.values() for name in added.get(registry, [])]
        assert len(names) == 1, f"docs/architecture.md registers {names or 'nothing'} in the {registry.kind} registry"
        return names[0]

    def module(self, registry):
        """The plugin module that registered in ``registry``."""
        path = next(path for path, added in self.added.items() if registry in added)
        return next(module for module in sys.modules.values() if getattr(module, "__file__", None) == path)


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    """Registrations are undone after the module, and the plugin modules forgotten."""
    saved = {
        registry: {
            key: value.copy()
            for key, value in vars(registry).items()
            if key.startswith("_") and isinstance(value, (dict, set))
        }
        for registry in REGISTRIES
    }
    folder = tmp_path_factory.mktemp("architecture")
    try:
        yield Examples(folder)
    finally:
        for registry, attributes in saved.items():
            for key, value in attributes.items():
                setattr(registry, key, value)
        for name in [
            name
            for name, module in sys.modules.items()
            if str(getattr(module, "__file__", None) or "").startswith(str(folder))
        ]:
            del sys.modules[name]


def test_every_block_registers_and_every_extension_point_has_an_example(examples):
    assert len(examples.plugins) == len(python_blocks())
    assert all(examples.added[path] for path in examples.plugins), "a block of docs/architecture.md registers nothing"
    for registry in REGISTRIES:
        examples.name(registry)


def test_the_task_builds_and_a_config_names_it(examples):
    name = examples.name(TASKS)
    config = unipg.load_config(
        None, plugins=examples.plugins, overrides=[f"task.name={name}", "task.options={test_fraction: 0.25}"]
    )
    task = make_task(name, **config.task.options)
    assert task.train and task.test and build_rewards(task.rewards)


def test_the_reward_builds_and_scores(examples):
    reward_fn = build_rewards([{"name": examples.name(REWARDS), "options": {"max_chars": 3}}])
    assert reward_fn(["q", "q"], ["abc", "abcdef"]).total == [1.0, 0.0]


def test_the_tool_is_called_under_its_registered_name(examples):
    name = examples.name(TOOLS)
    service = EnvironmentService(build_tools([{"name": name, "options": {"zone": "UTC"}}]), timeout=5.0, retries=0)
    try:
        assert list(service.tools) == [name]
        known = asyncio.run(service.call(name, {"city": "Lima"}))
        unknown = asyncio.run(service.call(name, {"city": "Atlantis"}))
        assert known.status == "ok" and "Lima" in known.observation
        assert unknown.status == "error" and "no time zone known for 'Atlantis'" in unknown.observation
    finally:
        service.close()


def test_the_tool_call_format_drives_a_tool_episode(examples):
    parser = examples.name(TOOL_PARSERS)
    unipg.load_config(None, plugins=examples.plugins, overrides=["task.name=calculator", f"model.tool_parser={parser}"])
    call = rewrite_calls(format_tool_call("calculator", {"expression": "6*7"}), parser)
    task = make_task("calculator", digits=1, num_train=4, num_test=2)
    service = EnvironmentService(build_tools(task.tools), timeout=5.0, retries=0)
    env = ENVS.get("tool")(task, build_rewards(task.rewards), service, tool_parser=parser)

    async def play():
        await env.reset(task.test[0])
        return await env.step(call), await env.step(task.test[0].answer)

    try:
        called, answered = asyncio.run(play())
    finally:
        service.close()
    assert called.info.tool_status == "ok" and called.observation == "42"
    assert answered.done and answered.info.correct


def test_the_environment_is_chosen_with_task_env_and_built_by_the_episode_runner(examples, tiny_policy):
    name = examples.name(ENVS)
    config = unipg.load_config(
        None, plugins=examples.plugins, overrides=[*TINY, f"task.env={name}", "task.env_options={rounds: 2}"]
    )
    task = make_task(config.task.name, **config.task.options)
    runner = EpisodeRunner(tiny_policy(), task, config, build_rewards(task.rewards))
    example = task.test[0]
    wrong = str(int(example.answer) + 1)

    async def play(env):
        first = await env.reset(example)
        return first, await env.step(wrong), await env.step(example.answer)

    try:
        env = runner.make_env()
        assert type(env) is ENVS.get(name) and env.rounds == 2
        first, hint, right = asyncio.run(play(env))
    finally:
        runner.close()
    assert first == example.prompt and hint.observation == "lower" and not hint.done
    assert right.done and right.reward == 1.0 and right.info.correct


def test_the_estimator_loss_engine_and_backend_train_one_update(examples, embedded_path, tmp_path, capsys):
    advantage, loss = examples.name(ADVANTAGES), examples.name(POLICY_LOSSES)
    engine, backend = examples.name(ENGINES), examples.name(BACKENDS)
    assert advantage_family(advantage) == "group"  # from the inputs it declares
    with pytest.raises(ConfigError, match=rf"did you mean '{engine}'"):  # checked like the built-in ones
        unipg.load_config(None, plugins=examples.plugins, overrides=[*TINY, f"sample.engine={engine[:-1]}"])
    with pytest.raises(ConfigError, match=rf"did you mean '{backend}'"):
        unipg.load_config(None, plugins=examples.plugins, overrides=[*TINY, f"backend={backend[:-1]}"])
    result = unipg.train(
        None,
        plugins=examples.plugins,
        overrides=[
            *TINY,
            f"estimator.advantage={advantage}",
            f"estimator.policy_loss={loss}",
            "estimator.clip_range=0.1",
            f"sample.engine={engine}",
            f"backend={backend}",
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
        ],
    )
    assert math.isfinite(result.metrics["train/loss"]) and "train/clip_fraction" in result.metrics
    assert examples.module(ENGINES).STARTED  # the run's episodes were sampled by the registered engine
    assert "episodes in this process, sequential schedule" in capsys.readouterr().out
