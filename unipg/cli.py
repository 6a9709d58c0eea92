"""Command line: ``unipg train | config | algorithms``.

``unipg train [--config FILE] [key=value ...]`` trains; overrides use dotted keys
(``estimator.clip_range=0.1``) or the flat keys of seed 000's reference config (``learning_rate=1e-3``).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import List, Optional

import typer
import yaml
from rich.console import Console
from rich.table import Table

from unipg.config import Config, ConfigError, load_config
from unipg.presets import ALGORITHMS

app = typer.Typer(add_completion=False, no_args_is_help=True, help="unipg: policy-gradient RL from CartPole to LLM agents.")
console = Console(width=None if sys.stdout.isatty() else 120)
errors = Console(stderr=True)


def resolve(config_path: Optional[Path], overrides: List[str]) -> Config:
    try:
        config = load_config(config_path, overrides)
    except ConfigError as error:
        errors.print(f"[bold red]error:[/] {error}", markup=True, highlight=False)
        raise typer.Exit(2) from None
    for warning in config.warnings:
        errors.print(f"[yellow]warning:[/] {warning}", highlight=False)
    return config


@app.command()
def train(
    overrides: List[str] = typer.Argument(None, help="dotted overrides, e.g. estimator.clip_range=0.1"),
    config_path: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config file"),
    seeds: Optional[str] = typer.Option(None, help="comma-separated seeds to run one after another, e.g. 0,1,2"),
    threshold: Optional[float] = typer.Option(None, help="report the first step whose eval mean return ≥ this"),
) -> None:
    """Train a policy; prints a result table at the end."""
    from unipg.run.classic import train_classic

    seed_list = parse_seeds(seeds)
    results = []
    for seed in seed_list or [None]:
        config = resolve(config_path, list(overrides or []) + ([f"seed={seed}"] if seed is not None else []))
        try:
            result = train_classic(config, return_threshold=threshold)
        except ValueError as error:  # bad environment ids and the like: say what, not where
            errors.print(f"[bold red]error:[/] {error}", highlight=False)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            errors.print(f"interrupted; the metrics written so far are kept under {config.log.output_dir}/")
            raise typer.Exit(130) from None
        results.append((config, result))
    console.print(result_table(results, threshold))


def parse_seeds(text: Optional[str]) -> list[int]:
    if not text:
        return []
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        errors.print(f"[bold red]error:[/] --seeds takes comma-separated integers such as 0,1,2, got '{text}'")
        raise typer.Exit(2) from None


def result_table(results, threshold: Optional[float] = None) -> Table:
    table = Table(title="unipg results")
    columns = ["algorithm", "env", "seed", "env steps", "episodes", "train return", "eval return", "steps/s"]
    if threshold is not None:
        columns.insert(7, f"steps to eval ≥ {threshold:g}")
    for column in columns:
        table.add_column(column, justify="left" if column in ("algorithm", "env") else "right")
    for config, result in results:
        row = [config.algorithm, config.env.id, str(config.seed), f"{result.env_steps:,}", str(result.episodes),
               f"{result.final_train_return:.1f}" if result.final_train_return is not None else "-",
               f"{result.final_eval_mean:.1f} ± {result.final_eval_std:.1f}", f"{result.steps_per_second:,.0f}"]
        if threshold is not None:
            row.insert(7, f"{result.steps_to_eval_threshold:,}" if result.steps_to_eval_threshold else "not reached")
        table.add_row(*row)
    captions = [f"runs in: {', '.join(str(result.run_dir) for _, result in results)}"]
    if len(results) > 1:
        means = [result.final_eval_mean for _, result in results]
        captions.insert(0, f"eval return over {len(means)} seeds: {statistics.fmean(means):.1f} ± {statistics.pstdev(means):.1f}")
    table.caption = "\n".join(captions)
    return table


@app.command("config")
def show_config(
    overrides: List[str] = typer.Argument(None, help="dotted overrides"),
    config_path: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config file"),
) -> None:
    """Print the fully resolved configuration (preset + file + overrides) as YAML."""
    config = resolve(config_path, list(overrides or []))
    console.print(yaml.safe_dump(config.to_dict(), sort_keys=False), highlight=False)


@app.command()
def algorithms() -> None:
    """List the named algorithm presets."""
    table = Table(title="algorithms")
    table.add_column("name")
    table.add_column("what it is")
    for name in sorted(ALGORITHMS):
        table.add_row(name, ALGORITHMS[name].summary)
    console.print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
