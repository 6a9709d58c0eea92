"""Command line: ``unipg train | eval | sft | doctor | plot | config | algorithms``.

``unipg train [--config FILE] [key=value ...]`` trains; overrides use dotted keys
(``estimator.clip_range=0.1``) or the flat keys of seed 000's reference config (``learning_rate=1e-3``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer
import yaml
from rich.console import Console
from rich.markup import escape

from unipg import api
from unipg.config import Config, ConfigError
from unipg.observe.report import (
    algorithm_table,
    choice_table,
    evaluation_table,
    gym_result_table,
    hyperparameter_list,
    lm_result_table,
)
from unipg.registry import RegistryError

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="unipg: policy-gradient RL from CartPole to LLM agents."
)
console = Console(width=None if sys.stdout.isatty() else 120)
errors = Console(stderr=True)


def print_error(message: str) -> None:
    """``error: <message>`` on stderr exactly as written: brackets in paths or values are not read as markup, and
    long lines are not wrapped."""
    errors.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def print_notice(message: str) -> None:
    """``notice: <message>`` on stderr, as ``print_error`` writes errors."""
    errors.print(f"[yellow]notice:[/] {escape(message)}", highlight=False, soft_wrap=True)


TRUST_OPTION = typer.Option(
    False, "--trust-folder-code", help="with --run/--resume: run the code the folder's config names (you trust it)"
)

IMPORTED: list[str] = []  # the plugins of --import, added to every config this command loads


@app.callback()
def import_option(
    imports: List[str] = typer.Option(
        None,
        "--import",
        metavar="MODULE",
        help="import a module or Python file that registers tasks, tools, rewards, "
        "environments or estimators (repeatable); added to the config's plugins",
    ),
) -> None:
    """unipg: policy-gradient RL from CartPole to LLM agents."""
    from unipg.config.plugins import import_plugins, resolve_plugins

    try:
        IMPORTED[:] = resolve_plugins(list(imports or []), Path.cwd(), "--import")
        import_plugins(IMPORTED)
    except ConfigError as error:
        print_error(str(error))
        raise typer.Exit(2) from None


def load_checked(config_path: Optional[Path], overrides: List[str]) -> Config:
    """``unipg.api.load_config``: the schema, the cross-field rules and the registered options."""
    return api.load_config(config_path, overrides=overrides, plugins=IMPORTED)


def resolve(config_path: Optional[Path], overrides: List[str]) -> Config:
    try:
        config = load_checked(config_path, overrides)
    except ConfigError as error:
        print_error(str(error))
        raise typer.Exit(2) from None
    for warning in config.warnings:
        errors.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False, soft_wrap=True)
    return config


@app.command()
def train(
    overrides: List[str] = typer.Argument(None, help="dotted overrides, e.g. estimator.clip_range=0.1"),
    config_path: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config file"),
    seeds: Optional[str] = typer.Option(None, help="comma-separated seeds, e.g. 0,1,2"),
    jobs: int = typer.Option(
        1,
        "--jobs",
        "-j",
        min=1,
        help="with --seeds: how many seeds train at once, each in "
        "its own process (one thread each for the embedded model)",
    ),
    threshold: Optional[float] = typer.Option(None, help="report the first step whose eval mean return ≥ this"),
    resume: Optional[Path] = typer.Option(
        None,
        "--resume",
        help="continue the run in this folder from its newest checkpoint; overrides apply on top of its config.yaml",
    ),
    backend: Optional[str] = typer.Option(
        None,
        "--backend",
        help="inprocess, or ray: rollout workers and environment "
        "actors on a local Ray instance, or on a cluster with ray.address=auto",
    ),
    trust_folder_code: bool = TRUST_OPTION,
) -> None:
    """Train a policy; prints a result table at the end."""
    overrides = list(overrides or []) + ([f"backend={backend}"] if backend is not None else [])
    if resume is not None:
        if config_path is not None or seeds:
            print_error(
                "--resume continues a run with its own config.yaml; drop --config and --seeds "
                "(key=value overrides still apply)"
            )
            raise typer.Exit(2)
        train_resumed(resume, overrides, threshold, trust_folder_code)
        return
    configs = seed_configs(config_path, overrides, parse_seeds(seeds))
    if jobs > 1 and len(configs) > 1:
        results = list(zip(configs, run_in_parallel(configs, threshold, jobs)))
    else:
        results = [(config, run_guarded(config, threshold)) for config in configs]
    table = lm_result_table(results) if results[0][0].is_lm else gym_result_table(results, threshold)
    if len(results) > 1:
        from unipg.observe.seeds import write_results_summary

        table.caption += f"\nmean ± std of every final metric: {write_results_summary(results)} (and .md)"
    console.print(table)


def train_resumed(run_dir: Path, overrides: List[str], threshold: Optional[float], trust_code: bool) -> None:
    """``unipg train --resume``: continue the run in ``run_dir`` and print its result table."""
    config = resolve_resumed(run_dir, list(overrides or []), trust_code)
    result = [(config, run_guarded(config, threshold, resume=run_dir))]
    console.print(lm_result_table(result) if config.is_lm else gym_result_table(result, threshold))


def seed_configs(config_path: Optional[Path], overrides: List[str], seed_list: list[int]) -> list[Config]:
    """One configuration per seed of ``--seeds`` (the one configuration when none is listed); with
    ``log.run_name`` set, each seed's run is named after it."""
    if seed_list and any(override.partition("=")[0].strip() == "seed" for override in overrides):
        print_error("the seed is set twice, by --seeds and by a seed= override; keep one of them")
        raise typer.Exit(2)
    configs = [
        resolve(config_path, list(overrides or []) + ([f"seed={seed}"] if seed is not None else []))
        for seed in seed_list or [None]
    ]
    if len(configs) > 1 and configs[0].log.run_name:  # a named run: one folder per seed, named after it
        name = configs[0].log.run_name
        configs = [
            resolve(config_path, list(overrides or []) + [f"seed={seed}", f"log.run_name={name}-seed{seed}"])
            for seed in seed_list
        ]
    return configs


def run_in_parallel(configs: list[Config], threshold: Optional[float], jobs: int) -> list:
    """``unipg.api.run_in_parallel``; a warm start that cannot be built, or a seed that fails, ends the command
    with its message."""
    try:
        outcomes = api.run_in_parallel(configs, threshold, jobs)
    except ValueError as error:
        print_error(str(error))
        raise typer.Exit(2) from None
    failed = [(config.seed, outcome) for config, outcome in zip(configs, outcomes) if isinstance(outcome, str)]
    for seed, message in failed:
        print_error(f"seed {seed}: {message}")
    if failed:
        raise typer.Exit(2)
    return outcomes


def resolve_resumed(run_dir: Path, overrides: List[str], trust_code: bool = False) -> Config:
    """The configuration of the run in ``run_dir`` (its config.yaml) with ``overrides`` applied."""
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        print_error(
            f"cannot resume from '{run_dir}': it is not a run folder (no config.yaml); pass the folder "
            "that `unipg train` created for the run"
        )
        raise typer.Exit(2)
    try:
        config = api.resumed_config(
            run_dir, overrides=overrides, notify=print_notice, plugins=IMPORTED, trust_code=trust_code
        )
    except ConfigError as error:
        print_error(str(error))
        raise typer.Exit(2) from None
    # config.warnings are not printed: config.yaml sets every key, so they would list all the unused ones.
    return config


def run_guarded(config: Config, threshold: Optional[float], resume: Optional[Path] = None):
    """Run one training job; bad input (a model path, an environment id) or a hang ends with a message alone."""
    from unipg.runtime.lm import TrainingStopped

    try:
        return api.run(config, resume=resume, return_threshold=threshold)
    # RegistryError: an unknown task or reward name; OSError: a folder that cannot be written, or a hang (WaitTimeout).
    except (ValueError, RegistryError, OSError) as error:
        print_error(str(error))
        raise typer.Exit(2) from None
    except TrainingStopped as stopped:
        errors.print(escape(f"{stopped}; a checkpoint was saved in {stopped.run_dir}/checkpoints"), highlight=False)
        raise typer.Exit(128 + stopped.signal_number) from None
    except KeyboardInterrupt as interrupted:  # a second Ctrl-C, or a stop given up before the first update
        number = getattr(interrupted, "signal_number", None) or 2
        errors.print(escape(f"interrupted; the metrics written so far are kept under {config.log.output_dir}/"))
        raise typer.Exit(128 + number) from None


@app.command()
def sft(
    overrides: List[str] = typer.Argument(None, help="dotted overrides, e.g. sft.steps=1000"),
    config_path: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config file (task, model, sft)"),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="folder for the fine-tuned model"),
) -> None:
    """Supervised fine-tuning on the task's demonstrations (completion-only loss); the warm start before RL."""
    from unipg.learn.warm_start import run_sft

    config = resolve(config_path, list(overrides or []))
    if not config.is_lm:
        print_error("sft needs a text task; set task.name (e.g. task.name=arithmetic)")
        raise typer.Exit(2)
    try:
        report = run_sft(config, output)
    except (ValueError, RegistryError) as error:
        print_error(str(error))
        raise typer.Exit(2) from None
    console.print(
        f"held-out greedy accuracy {report['before']:.3f} → {report['after']:.3f}; model saved to {report['output']}"
    )


def parse_seeds(text: Optional[str]) -> list[int]:
    """``"0,1,2"`` → [0, 1, 2]; anything else ends the command with a message (exit code 2)."""
    if not text:
        return []
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        print_error(f"--seeds takes comma-separated integers such as 0,1,2, got '{text}'")
        raise typer.Exit(2) from None
    repeated = sorted({seed for seed in seeds if seeds.count(seed) > 1})
    if repeated:
        print_error(
            f"--seeds lists seed {', '.join(map(str, repeated))} more than once; each seed trains one run, "
            "so list every seed once"
        )
        raise typer.Exit(2)
    return seeds


@app.command("config")
def show_config(
    overrides: List[str] = typer.Argument(None, help="dotted overrides; with --explain, keys or sections"),
    config_path: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config file"),
    explain: bool = typer.Option(
        False,
        "--explain",
        help="explain the keys or sections named (all when none is): "
        "type, default, help and the modes that read each key",
    ),
) -> None:
    """Print the fully resolved configuration (preset + file + overrides) as YAML; with --explain, what each key
    means (``unipg config --explain estimator.clip_range``, ``unipg config --explain sample``)."""
    if explain:
        from unipg.config.explain import explain as explain_keys

        try:
            typer.echo(explain_keys(list(overrides or [])))
        except ConfigError as error:
            print_error(str(error))
            raise typer.Exit(2) from None
        return
    config = resolve(config_path, list(overrides or []))  # printed as a run saves it: its secrets redacted
    console.print(yaml.safe_dump(config.to_dict(redacted=True), sort_keys=False), highlight=False)


@app.command()
def algorithms() -> None:
    """List the algorithm presets, then every estimator of each registry with the hyperparameters it accepts
    (and their defaults): what ``estimator.<name>`` can be set to."""
    from unipg.config.hyperparameters import CHOICES, general_settings

    console.print(algorithm_table())
    for choice in CHOICES:
        console.print(choice_table(choice))
    console.print(
        f"read whatever the estimators chosen: {hyperparameter_list(general_settings())}",
        highlight=False,
        soft_wrap=True,
    )


@app.command("eval")
def evaluate(
    overrides: List[str] = typer.Argument(None, help="dotted overrides, e.g. eval.max_examples=500"),
    config_path: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config file (task, model, eval)"),
    run: Optional[Path] = typer.Option(None, "--run", help="a finished run folder: evaluate the policy it saved"),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="also write the metrics to this JSON file"),
    show: int = typer.Option(
        0, "--show", min=0, help="print this many held-out episodes: prompt, tool calls and results, answer, reward"
    ),
    trust_folder_code: bool = TRUST_OPTION,
) -> None:
    """Evaluate a model on a text task's held-out split: completion (pass@1), pass@k, turns, tool use."""
    import json

    try:
        if run is not None:
            if config_path is not None:
                raise ValueError("--run evaluates with the run's own config.yaml; drop --config")
            config = api.evaluation_config(
                run, overrides=list(overrides or []), notify=print_notice, trust_code=trust_folder_code
            )
        else:
            config = resolve(config_path, list(overrides or []))
        metrics, transcripts = api.evaluate_episodes(config, show=show)
    except (ValueError, ConfigError, RegistryError) as error:
        print_error(str(error))
        raise typer.Exit(2) from None
    print_transcripts(transcripts)
    console.print(evaluation_table(config, metrics))
    if output is not None:
        output.write_text(json.dumps(metrics, indent=2), encoding="utf-8")


def print_transcripts(transcripts: list[dict]) -> None:
    """Each transcript in a panel on a terminal, as plain text otherwise (a pipe, a file)."""
    from rich.panel import Panel

    from unipg.sample.transcripts import format_transcript

    for index, record in enumerate(transcripts, 1):
        title = f"episode {index}: {'correct' if record['correct'] else 'wrong'}"
        if console.is_terminal:
            console.print(Panel(escape(format_transcript(record)), title=title, title_align="left"))
        else:
            typer.echo(f"--- {title}\n{format_transcript(record)}\n")


@app.command()
def doctor(
    run_dir: Path = typer.Argument(..., help="folder of a training run (holds metrics.jsonl)"),
    as_json: bool = typer.Option(False, "--json", help="print the findings as a JSON list"),
) -> None:
    """Diagnose a run from its metrics: flat or oscillating reward, KL spikes, entropy collapse, slow steps, ..."""
    from unipg.observe.doctor import diagnose_run, findings_json, format_report

    try:
        findings = diagnose_run(run_dir)
    except ValueError as error:
        print_error(str(error))
        raise typer.Exit(2) from None
    typer.echo(findings_json(findings) if as_json else format_report(findings))


@app.command()
def plot(
    run_dirs: List[Path] = typer.Argument(..., help="run folders; runs that differ only in seed are averaged"),
    out: Path = typer.Option(Path("plots"), "--out", "-o", help="folder for the PNG files"),
    metric: Optional[List[str]] = typer.Option(
        None, "--metric", "-m", help="metric group (reward, eval, kl, ...) or metric; repeatable"
    ),
) -> None:
    """Plot learning curves, one PNG per metric group, with mean and min-max band over seeds."""
    from unipg.observe.plots import plot_runs

    try:
        paths = plot_runs(list(run_dirs), out, metrics=list(metric) if metric else None)
    except ValueError as error:
        print_error(str(error))
        raise typer.Exit(2) from None
    for path in paths:
        typer.echo(str(path))


def main() -> None:
    from unipg.observe.metrics import limit_malloc_arenas, quiet_libraries

    limit_malloc_arenas()  # before any thread starts: resident memory stays flat in long runs
    quiet_libraries()
    app()


if __name__ == "__main__":
    main()
