"""The lm result table: greedy completion, and the sampled completion rate beside it when evaluation sampled."""

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


def test_the_sampled_completion_rate_has_its_column_next_to_greedy_completion():
    table, headers, text = table_for({"eval/pass@1": 0.9, "eval/pass@2": 0.6, "eval/sampled_completion": 0.35})
    assert headers == ["seed", "completion", "sampled", "pass@2", "samples/s"]
    assert "0.000 → 0.350" in text and "completion greedy; sampled and pass@k sampled" in table.title


def test_greedy_only_evaluation_keeps_the_greedy_title():
    table, headers, _ = table_for({"eval/pass@1": 0.9})
    assert headers == ["seed", "completion", "samples/s"] and "held-out, greedy, before" in table.title
