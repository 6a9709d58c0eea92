"""A checkpoint keeps the rollout's episode counts as of its update, handed to the save by the driver, and a
resumed run goes on counting from them."""

from unipg.checkpoint.store import CheckpointStore, load_checkpoint
from unipg.config import load_config
from unipg.observe.metrics import read_metrics
from unipg.runtime.lm import train_lm

RUN = [
    "task.name=arithmetic",
    "task.options={digits: 1, num_train: 40, num_test: 4}",
    "train.batch_size=8",
    "train.mini_batch_size=8",
    "sample.samples_per_prompt=4",
    "sample.max_new_tokens=4",
    "eval.every_updates=100",
    "eval.pass_k=0",
    "log.progress=false",
    "log.tensorboard=false",
    "deterministic=true",
    "algorithm=grpo",
    "checkpoint.every_updates=1",
    "log.run_name=counts",
]


def test_a_checkpoint_keeps_its_updates_episode_counts_and_a_resumed_run_continues_them(embedded_path, tmp_path):
    overrides = [*RUN, f"model.name={embedded_path}", f"log.output_dir={tmp_path}"]
    first = train_lm(load_config(None, [*overrides, "train.updates=2"]), log=lambda line: None)
    saved = load_checkpoint(CheckpointStore(first.run_dir / "checkpoints").latest())
    assert saved.step == 2 and saved.state["episodes"] == {
        "started": 16,
        "finished": 16,
        "failed": 0,
        "requeued": 0,
        "cancelled": 0,
        "in_flight": 0,
    }
    resumed = train_lm(load_config(None, [*overrides, "train.updates=3"]), resume=first.run_dir, log=lambda line: None)
    last = [record for record in read_metrics(resumed.run_dir) if "rollout/episodes_started" in record][-1]
    assert last["step"] == 3 and last["rollout/episodes_started"] == last["rollout/episodes_finished"] == 24
