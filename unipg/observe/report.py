"""The tables a finished command prints: results of gym and lm runs, a held-out evaluation (``unipg eval``), and
the algorithms with the estimator settings each accepts (``unipg algorithms``, and docs/algorithms.md)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional

from rich.markup import escape
from rich.table import Table

from unipg.config.hyperparameters import default
from unipg.config.presets import ALGORITHMS
from unipg.estimate import ADVANTAGES
from unipg.estimate.families import baseline_of, loss_axes

LM_COLUMN_NAMES = {
    "eval/sampled_completion": "sampled",
    "eval/pass@1": "greedy",
    "eval/tool_calls": "tool calls",
    "eval/tool_success_rate": "tool success",
    "eval/turns": "turns",
}


def value_text(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"  # e.g. the tool success rate of a policy that never called


def lm_result_table(results) -> Table:
    """One row per run; what all runs share (algorithm, task, model, updates) goes into the title."""
    described = [
        (
            config.algorithm,
            config.task.name,
            Path(config.model.name).name or config.model.name,
            str(result.updates),
            f"{result.samples:,}",
        )
        for config, result in results
    ]
    shared = len(set(described)) == 1
    temperature, final = results[0][0].sample.temperature, results[0][1].final_eval
    sampled = "eval/sampled_completion" in final
    title = "unipg results: held-out (test split), before → after training"
    if shared:
        algorithm, task, model, updates, samples = described[0]
        title = f"{algorithm} on {task} with {model}: {updates} updates, {samples} samples\n{title}"
    table = Table(title=title)
    passes = [key for key in final if key.startswith("eval/pass@") and key != "eval/pass@1"]
    keys = ["eval/sampled_completion", "eval/pass@1", *passes] if sampled else ["eval/pass@1"]
    if "eval/tool_calls" in final:
        keys += ["eval/tool_calls", "eval/tool_success_rate", "eval/turns"]
    columns = ["seed"] if shared else ["algorithm", "task", "model", "seed", "updates", "samples"]
    columns += [LM_COLUMN_NAMES.get(key, key[5:]) for key in keys] + ["samples/s"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("algorithm", "task", "model") else "right")
    for (config, result), description in zip(results, described):
        row = [str(config.seed)] if shared else [*description[:3], str(config.seed), *description[3:]]
        row += [
            f"{value_text(result.initial_eval.get(key))} → {value_text(result.final_eval.get(key))}" for key in keys
        ]
        table.add_row(*row, f"{result.samples_per_second:.1f}")
    runs = ", ".join(str(result.run_dir) for _, result in results)
    table.caption = f"{result_legend(keys, temperature)}\nruns in: {runs}"
    if len(results) > 1:
        completions = [key for key in keys if key in ("eval/sampled_completion", "eval/pass@1")]
        gains = " and ".join(
            f"{LM_COLUMN_NAMES[key]} {gain_text([r.final_eval[key] - r.initial_eval[key] for _, r in results])}"
            for key in completions
        )
        table.caption = f"gain over {len(results)} seeds: {gains}\n" + table.caption
    return table


def gain_text(gains: list[float]) -> str:
    return f"{statistics.fmean(gains):+.3f} ± {statistics.pstdev(gains):.3f}"


def result_legend(keys: list[str], temperature: float) -> str:
    """One line saying what each column of ``lm_result_table`` measures."""
    meaning = {
        "eval/sampled_completion": f"sampled: share of episodes solved at the training temperature {temperature:g} "
        "(the policy as trained)",
        "eval/pass@1": "greedy: the most likely token at every step",
        "eval/tool_calls": "tool calls, tool success, turns: of the greedy episodes",
    }
    for key in keys:
        if key.startswith("eval/pass@") and key != "eval/pass@1":
            meaning[key] = f"{key[5:]}: any of {key.split('@')[1]} sampled episodes solved"
    return "; ".join(meaning[key] for key in keys if key in meaning)


def gym_result_table(results, threshold: Optional[float] = None) -> Table:
    table = Table(title="unipg results")
    columns = ["algorithm", "env", "seed", "env steps", "episodes", "train return", "eval return", "steps/s"]
    if threshold is not None:
        columns.insert(7, f"steps to eval ≥ {threshold:g}")
    for column in columns:
        table.add_column(column, justify="left" if column in ("algorithm", "env") else "right")
    for config, result in results:
        row = [
            config.algorithm,
            config.env.id,
            str(config.seed),
            f"{result.env_steps:,}",
            str(result.episodes),
            f"{result.final_train_return:.1f}" if result.final_train_return is not None else "-",
            f"{result.final_eval_mean:.1f} ± {result.final_eval_std:.1f}",
            f"{result.steps_per_second:,.0f}",
        ]
        if threshold is not None:
            row.insert(7, f"{result.steps_to_eval_threshold:,}" if result.steps_to_eval_threshold else "not reached")
        table.add_row(*row)
    captions = [f"runs in: {', '.join(str(result.run_dir) for _, result in results)}"]
    if len(results) > 1:
        means = [result.final_eval_mean for _, result in results]
        captions.insert(
            0, f"eval return over {len(means)} seeds: {statistics.fmean(means):.1f} ± {statistics.pstdev(means):.1f}"
        )
    table.caption = "\n".join(captions)
    return table


def evaluation_table(config, metrics: dict[str, float | None]) -> Table:
    """One row per held-out metric of ``config``'s model on its task."""
    table = Table(title=f"held-out evaluation on {config.task.name}", caption=f"model: {escape(config.model.name)}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in metrics.items():
        table.add_row(LM_COLUMN_NAMES.get(key, key), value_text(value))
    return table


def algorithm_axes() -> list[dict[str, str]]:
    """Each preset's choice on every axis of the family J = E_μ[ρ · A · w]: one row per preset and setting (gym, text)
    with name, setting, advantage, baseline, ratio (level), weight (shape), aggregation, KL (placement) and summary."""
    rows = []
    for name in sorted(ALGORITHMS):
        algorithm = ALGORITHMS[name]
        for setting, preset in (("gym", algorithm.preset), ("text", algorithm.lm_preset)):
            if preset is None:
                continue
            chosen = preset["estimator"]
            read = lambda key: chosen.get(key, default(key))  # noqa: E731
            ratio, weight = loss_axes(read("policy_loss"))
            rows.append(
                {
                    "name": name,
                    "setting": setting,
                    "advantage": read("advantage"),
                    "baseline": baseline_of(read("advantage")),
                    "ratio": ratio,
                    "weight": weight,
                    "aggregation": read("loss_agg_mode") if setting == "text" else "mean over steps",
                    "KL": kl_placement(read) if setting == "text" else "none",
                    "summary": algorithm.summary,
                }
            )
    return rows


def kl_placement(read) -> str:
    """Where a text preset pays its KL to the reference: in each token's reward, as a loss term, or not at all."""
    coef = read("kl_coef")
    if coef <= 0:
        return "none"
    kind = "in reward" if read("kl_in_reward") else "loss term"
    return f"{kind} {read('kl_estimator')}, β {coef}"


def algorithm_table() -> Table:
    """One row per preset and setting (gymnasium, text): its choice on each axis of the family, and what it is."""
    table = Table(title="algorithms")
    for column in ("name", "advantage (baseline)", "ratio · weight", "aggregation", "KL", "what it is"):
        table.add_column(column)
    for row in algorithm_axes():
        table.add_row(
            f"{row['name']} ({row['setting']})",
            f"{row['advantage']} ({row['baseline']})",
            f"{row['ratio']} · {row['weight']}",
            row["aggregation"],
            row["KL"],
            row["summary"],
        )
    return table


def choice_table(choice) -> Table:
    """The entries ``estimator.<selector>`` can name, each with its summary and accepted hyperparameters."""
    table = Table(title=f"estimator.{choice.selector} ({choice.kind})")
    for column in ("name", "hyperparameters (default)", "what it is"):
        table.add_column(column)
    for name in choice.names():
        registry = choice.registry_of(name)
        table.add_row(name, hyperparameter_list(choice.options(name)) or "–", registry.entry(name).summary)
    return table


def hyperparameter_list(names: list[str]) -> str:
    """``clip_range=0.2, dual_clip=None``: estimator settings with their defaults."""
    return ", ".join(f"{name}={default(name)}" for name in names)


ALGORITHMS_DOC_INTRO = """# Algorithms as choices in one family

Every method unipg trains is the one objective J(θ) = E_μ[ρ · A · w(ρ, age)], ρ = π_θ/μ, with a choice on each
axis: the level the ratio is taken at (token or sequence), the shape of the weight (hard clip, soft gate, clipped
weight with its gradient stopped, ...), the advantage and its baseline, how per-token losses are reduced, and where
the KL to a reference model is paid. A new method is a registry entry that picks its answers, never a branch in the
learner. `unipg algorithms` prints the same tables with each estimator's hyperparameters and their defaults.

This page is generated: `python -m unipg.observe.report > docs/algorithms.md`.
"""


def _markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def algorithms_markdown() -> str:
    """docs/algorithms.md: the presets on every axis, then every registered policy loss and advantage estimator."""
    from unipg.config.hyperparameters import CHOICES

    presets = [
        [
            f"`{r['name']}`",
            r["setting"],
            r["advantage"],
            r["baseline"],
            r["ratio"],
            r["weight"],
            r["aggregation"],
            r["KL"],
        ]
        for r in algorithm_axes()
    ]
    losses, advantages = CHOICES[1], CHOICES[0]
    loss_rows = [
        [
            f"`{name}`",
            *loss_axes(name),
            ", ".join(losses.options(name)) or "–",
            losses.registry_of(name).entry(name).summary,
        ]
        for name in losses.names()
    ]
    advantage_rows = [
        [f"`{name}`", baseline_of(name), ", ".join(advantages.options(name)) or "–", ADVANTAGES.entry(name).summary]
        for name in advantages.names()
    ]
    sections = [
        ALGORITHMS_DOC_INTRO,
        "## Presets (`algorithm=`)\n",
        _markdown_table(
            ["preset", "setting", "advantage", "baseline", "ratio", "weight", "aggregation", "KL"], presets
        ),
        "\n## Policy losses (`estimator.policy_loss=`)\n",
        _markdown_table(["name", "ratio", "weight", "options", "what it is"], loss_rows),
        "\n## Advantage estimators (`estimator.advantage=`)\n",
        _markdown_table(["name", "baseline", "options", "what it is"], advantage_rows),
    ]
    return "\n".join(sections) + "\n"


if __name__ == "__main__":
    print(algorithms_markdown(), end="")
