"""The public Python API: what a notebook or a script imports from ``unipg``.

    >>> import unipg
    >>> result = unipg.train("configs/cartpole_ppo.yaml", train__updates=2)   # doctest: +SKIP
    >>> result.run_dir, result.metrics["eval/return_mean"]                    # doctest: +SKIP

Overrides are keyword arguments whose double underscores stand for the dots of a config key
(``estimator__clip_range=0.1`` is ``estimator.clip_range=0.1``); the command line's ``key=value`` strings are
accepted as they are through ``overrides=[...]``. The command line (``unipg.cli``) calls these functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unipg.config import Config, ConfigError
from unipg.config import load_config as _load_config_file
from unipg.config.plugins import import_plugins
from unipg.sample.validate import check_sample_options


@dataclass
class RunResult:
    """What ``train`` returns: the run's folder, the final value of every metric it logged, and the mode's own
    result (``GymTrainResult`` for gymnasium runs, ``LMTrainResult`` for language-model runs) as ``details``."""

    run_dir: Path
    metrics: dict[str, float]
    """the last finite value of each metric in the run's metrics.jsonl."""
    config: Config
    details: Any


def load_config(
    source: str | Path | Config | None = None,
    *,
    overrides: list[str] | None = None,
    plugins: list[str] | None = None,
    **settings: Any,
) -> Config:
    """A validated ``Config`` from a YAML file (or an existing ``Config``), ``key=value`` ``overrides`` and
    keyword ``settings`` (``train__updates=2``); raises ``ConfigError`` saying what to fix.

    ``plugins`` (module names or Python files) are added to the config's own ``plugins``; all of them are
    imported first, so that the tasks, tools and rewards they register can be named. Besides the schema and
    its cross-field rules, the options of the task, rewards and tools are checked against their registries
    here, before anything runs.
    """
    pairs = _override_pairs(overrides, settings)
    if isinstance(source, Config):
        config = source if not pairs and not plugins else _rebuild(source, pairs, plugins)
    else:
        config = _load_config_file(source, pairs, plugins=plugins)
    import_plugins(config.plugins)  # a Config built in Python has not imported them yet
    check_sample_options(config)
    _check_backend(config)
    return config


def train(
    config: str | Path | Config | None = None,
    *,
    overrides: list[str] | None = None,
    resume: str | Path | None = None,
    return_threshold: float | None = None,
    plugins: list[str] | None = None,
    trust_code: bool = False,
    **settings: Any,
) -> RunResult:
    """Train the policy ``config`` describes and return its ``RunResult``.

    ``config`` is a YAML path, a ``Config`` or None (the defaults); ``settings`` override it
    (``train__updates=2``); ``plugins`` are imported and added to its ``plugins`` (``load_config``).
    ``resume`` continues a run from its folder's newest checkpoint, with that folder's config.yaml
    (``config`` must then be None); the code that folder names runs only if named again or with ``trust_code``
    (``resumed_config``).
    """
    from unipg.observe.seeds import final_metrics

    if resume is not None:
        if config is not None:
            raise ConfigError("resume continues a run with its own config.yaml; pass config=None")
        loaded = resumed_config(resume, overrides=overrides, plugins=plugins, trust_code=trust_code, **settings)
    else:
        loaded = load_config(config, overrides=overrides, plugins=plugins, **settings)
    details = run(loaded, resume=resume, return_threshold=return_threshold)
    return RunResult(details.run_dir, final_metrics(details.run_dir), loaded, details)


def resumed_config(
    run_dir: str | Path,
    *,
    overrides: list[str] | None = None,
    notify: Callable[[str], None] | None = None,
    plugins: list[str] | None = None,
    trust_code: bool = False,
    **settings: Any,
) -> Config:
    """The configuration of the run in ``run_dir`` (its config.yaml) with ``overrides`` and ``settings`` applied,
    as ``load_config`` checks it. A run folder is data: the code it names (plugins, ``task.agent``, tool servers,
    ``model.trust_remote_code``, ...) is not run unless the overrides or ``plugins`` name it again or
    ``trust_code`` is set (``unipg.config.run_folder``); ``notify`` (default: standard error) says what was left
    out."""
    from unipg.config.run_folder import read_run_folder
    from unipg.runtime.evaluation import notify_stderr

    return read_run_folder(
        Path(run_dir),
        _override_pairs(overrides, settings),
        plugins=plugins,
        trust_code=trust_code,
        notify=notify or notify_stderr,
        check=check_sample_options,
    )


def run(config: Config, *, resume: str | Path | None = None, return_threshold: float | None = None):
    """Train a loaded ``config`` in its mode and return the mode's result: a language model on a text task
    or an MLP on a gymnasium environment (``return_threshold`` marks when the evaluation return first reaches
    it), continuing the run in ``resume`` if given."""
    import_plugins(config.plugins)  # this process may not have loaded the config (a child of `train --jobs`)
    with _no_exit("the run's folder keeps what was written"):
        if config.is_lm:
            from unipg.runtime.lm import train_lm

            return train_lm(config, resume=resume)
        from unipg.runtime.gym import train_gym

        return train_gym(config, return_threshold=return_threshold, resume=resume)


@contextlib.contextmanager
def _no_exit(kept: str) -> Iterator[None]:
    """Within ``with``: a ``SystemExit`` raised by code a run calls (a plugin's tool, reward or agent) becomes a
    ``ValueError`` naming the file and line that exited. Nothing in unipg exits from inside a run, and an exit
    there would end the caller's process (a notebook, or ``unipg train`` with status 0 and nothing said)."""
    try:
        yield
    except SystemExit as exit:
        frame = exit.__traceback__
        while frame is not None and frame.tb_next is not None:
            frame = frame.tb_next
        where = f" at {frame.tb_frame.f_code.co_filename}:{frame.tb_lineno}" if frame is not None else ""
        raise ValueError(
            f"code the run called ended it with sys.exit({exit.code!r}){where}; a tool, reward or agent must "
            f"return or raise, not exit the process; {kept}"
        ) from None


def run_in_parallel(configs: list[Config], threshold: float | None, jobs: int) -> list:
    """``run`` each config in a process of its own, ``jobs`` at a time; in the order of ``configs``, each one's
    result, or the message of the error (a ValueError or RegistryError) that stopped it.

    A shared warm start is built once, here, before the processes start, so they all find it cached (a
    ValueError when it cannot be built).
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    if configs[0].is_lm and configs[0].model.warm_start:
        from unipg.learn.warm_start import resolve_warm_start
        from unipg.sample.episodes import build_task

        resolve_warm_start(configs[0], build_task(configs[0]))
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_train_in_child, configs, [threshold] * len(configs)))


def _train_in_child(config: Config, threshold: float | None):
    """One seed of ``run_in_parallel``: the result, or the message of the error that stopped it."""
    from unipg.config.timeouts import WaitTimeout
    from unipg.observe.metrics import quiet_libraries
    from unipg.registry import RegistryError

    quiet_libraries()
    try:
        return run(config, return_threshold=threshold)
    except (ValueError, RegistryError, WaitTimeout) as error:
        return str(error)


def evaluate(source: str | Path | Config, *, overrides: list[str] | None = None, **settings: Any) -> dict[str, float]:
    """Held-out metrics (greedy, the task's test split) of the policy a language-model run saved in the folder
    ``source``, or of ``source.model.name`` when ``source`` is a ``Config``."""
    from unipg.runtime.evaluation import evaluate_model

    config = source if isinstance(source, Config) else evaluation_config(source, overrides=overrides, **settings)
    with _no_exit("nothing was evaluated"):
        return evaluate_model(config)


def evaluate_episodes(
    source: str | Path | Config, *, show: int, overrides: list[str] | None = None, **settings: Any
) -> tuple[dict[str, float], list[dict]]:
    """``evaluate``, and the transcripts of the first ``show`` held-out greedy episodes: prompt, each tool call
    with its arguments and result, the answer and the reward (``unipg.sample.transcripts``)."""
    from unipg.runtime.evaluation import evaluate_model_episodes

    config = source if isinstance(source, Config) else evaluation_config(source, overrides=overrides, **settings)
    with _no_exit("nothing was evaluated"):
        return evaluate_model_episodes(config, show=show)


def evaluation_config(
    run_dir: str | Path,
    *,
    overrides: list[str] | None = None,
    notify: Callable[[str], None] | None = None,
    trust_code: bool = False,
    **settings: Any,
) -> Config:
    """The configuration of the finished run in ``run_dir``, pointed at the policy it saved; the code the folder
    names is not run unless the overrides name it again or ``trust_code`` is set (``notify`` says what was left
    out, as in ``resumed_config``)."""
    from unipg.runtime.evaluation import notify_stderr, run_config

    return run_config(
        Path(run_dir), _override_pairs(overrides, settings), notify or notify_stderr, trust_code=trust_code
    )


def _check_backend(config: Config) -> None:
    from unipg.registry import RegistryError
    from unipg.runtime.backends import BACKENDS

    try:
        BACKENDS.entry(config.backend)
    except RegistryError as error:
        raise ConfigError(f"backend: {error}") from None


def _override_pairs(overrides: list[str] | None, settings: dict[str, Any]) -> list[str]:
    """``key=value`` strings: the given ``overrides``, then ``settings`` with ``__`` read as ``.``."""
    return list(overrides or []) + [f"{key.replace('__', '.')}={_yaml_value(value)}" for key, value in settings.items()]


def _yaml_value(value: Any) -> str:
    """A Python value as the YAML text an override carries (``[1, 2]``, ``{path: data}``, ``true``)."""
    import yaml

    if isinstance(value, str):
        return value
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...").strip()


def _rebuild(config: Config, overrides: list[str], plugins: list[str] | None = None) -> Config:
    """``config`` with ``key=value`` overrides applied and ``plugins`` added, validated again as a whole."""
    from unipg.config.loading import build_config, parse_override, set_dotted, with_plugins

    tree = config.model_dump(exclude_unset=True)
    for override in overrides:
        key, value = parse_override(override)
        set_dotted(tree, key, value)
    return build_config(with_plugins(tree, plugins))
