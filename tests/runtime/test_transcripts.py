"""Transcripts of held-out episodes: written at every evaluation of a run, printed by ``unipg eval --show``."""

import json

import pytest
from typer.testing import CliRunner

from unipg.cli import app
from unipg.config import load_config
from unipg.learn.warm_start import resolve_warm_start
from unipg.observe.metrics import read_metrics
from unipg.runtime.lm import train_lm
from unipg.tasks.base import make_task

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_torch_thread")]

TASK_OPTIONS = {"digits": 1, "num_train": 16, "num_test": 4, "tool_demonstrations": 1.0}
CALCULATOR = [
    "task.name=calculator",
    f"task.options={json.dumps(TASK_OPTIONS)}",
    "agent.tool_prompt=false",
    "sample.max_new_tokens=96",
    "agent.max_total_tokens=160",
    "train.batch_size=8",
    "train.mini_batch_size=8",
    "train.micro_batch_size=8",
    "sample.samples_per_prompt=4",
    "eval.pass_k=0",
    "log.progress=false",
]


@pytest.fixture(scope="module")
def tool_caller(private_cache) -> str:
    """The embedded model fine-tuned until it writes well-formed calculator calls (100 steps on calls only)."""
    config = load_config(
        None, CALCULATOR + ["model.warm_start=true", "sft.steps=100", "sft.batch_size=8", "sft.learning_rate=0.01"]
    )
    return resolve_warm_start(config, make_task("calculator", **TASK_OPTIONS), log=lambda text: None).model.name


@pytest.fixture(scope="module")
def short_run(tool_caller, tmp_path_factory):
    output = tmp_path_factory.mktemp("runs")
    config = load_config(
        None,
        CALCULATOR
        + [
            f"model.name={tool_caller}",
            f"log.output_dir={output}",
            "train.updates=1",
            "eval.every_updates=1",
            "eval.transcripts=2",
            "log.tensorboard=true",
        ],
    )
    return train_lm(config).run_dir


def test_every_evaluation_writes_transcripts_to_the_run_folder_and_tensorboard(short_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for update in (0, 1):
        records = [json.loads(line) for line in (short_run / "transcripts" / f"eval_{update}.jsonl").open()]
        assert len(records) == 2
        assert [record["prompt"] for record in records] == [
            e.prompt for e in make_task("calculator", **TASK_OPTIONS).test[:2]
        ]
        first_turn = records[0]["turns"][0]
        assert first_turn["call"]["name"] == "calculator" and "expression" in first_turn["call"]["arguments"]
        assert first_turn["status"] == "ok" and first_turn["result"]
        assert isinstance(records[0]["reward"], float) and records[0]["finish"] == "done"
    events = EventAccumulator(str(short_run / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    texts = events.Tensors("eval/transcripts/text_summary")
    assert [event.step for event in texts] == [0, 1]
    assert "call:      calculator(expression=" in texts[0].tensor_proto.string_val[0].decode()


def test_eval_show_prints_episodes_with_their_calls_and_results(short_run):
    result = CliRunner().invoke(app, ["eval", "--run", str(short_run), "--show", "2"])
    assert result.exit_code == 0, result.output
    assert result.output.count("--- episode") == 2 and result.output.count("prompt:    What is") == 2
    # the 100-step fine-tune writes a well-formed call in most greedy episodes, not in every one on every CPU
    # (float32 rounding differs by vector width); a malformed call is shown too, with its status
    assert result.output.count("call:      ") >= 2 and result.output.count("call:      calculator(expression=") >= 1
    assert result.output.count("result:") >= 2 and result.output.count("reward:") == 2
    assert "greedy" in result.output  # the metrics table follows


def test_single_turn_transcripts_hold_the_answer_and_can_be_switched_off(embedded_path, tmp_path):
    """The same runs log the learning signal of their groups at every update (what the doctor reads)."""
    from tests.helpers.configs import TWO_EVALUATED_UPDATES as SMALL

    for count in (1, 0):
        config = load_config(
            None,
            SMALL
            + [
                f"model.name={embedded_path}",
                f"log.output_dir={tmp_path}",
                f"log.run_name=t{count}",
                "train.updates=2",
                f"eval.transcripts={count}",
            ],
        )
        run_dir = train_lm(config).run_dir
        updates = [record for record in read_metrics(run_dir) if "rollout/reward_mean" in record]
        assert len(updates) == 2 and all(
            0.0 <= record[f"rollout/{kind}_group_fraction"] <= 1.0
            for record in updates
            for kind in ("uniform", "unsolved", "solved")
        )
        folder = run_dir / "transcripts"
        if count:
            [record] = [json.loads(line) for line in (folder / "eval_2.jsonl").open()]
            assert record["turns"] == [{"text": record["answer"]}] and record["reference"]
        else:
            assert not folder.exists()
