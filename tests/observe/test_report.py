"""The lm result table: the sampled completion rate (the policy as trained) first when evaluation sampled, greedy
completion beside it, and a legend saying what each column measures."""

from types import SimpleNamespace

from rich.console import Console

from unipg.config import load_config
from unipg.observe.report import lm_result_table


def table_for(final: dict):
    config = load_config(None, ["task.name=arithmetic"])
    result = SimpleNamespace(
        updates=2,
        samples=16,
        samples_per_second=10.0,
        run_dir="runs/r",
        initial_eval={key: 0.0 for key in final},
        final_eval=final,
    )
    table = lm_result_table([(config, result)])
    console = Console(width=200, record=True)
    console.print(table)
    return table, [column.header for column in table.columns], console.export_text()


def test_the_sampled_completion_rate_leads_with_greedy_completion_beside_it_and_a_legend():
    table, headers, text = table_for({"eval/pass@1": 0.9, "eval/pass@2": 0.6, "eval/sampled_completion": 0.35})
    assert headers == ["seed", "sampled", "greedy", "pass@2", "samples/s"]
    assert "0.000 → 0.350" in text and "held-out (test split)" in table.title
    assert "sampled: share of episodes solved at the training temperature 1 (the policy as trained)" in table.caption
    assert "greedy: the most likely token" in table.caption and "pass@2: any of 2 sampled" in table.caption


def test_greedy_only_evaluation_shows_the_greedy_column():
    table, headers, _ = table_for({"eval/pass@1": 0.9})
    assert headers == ["seed", "greedy", "samples/s"] and "sampled" not in table.caption
