"""backend: ray with train.learner_processes=2: the learner's ranks are Ray actors in a placement group. One
update equals the one-process update and its checkpoint loads in one process; a run with 2 Ray learner ranks
trains like a one-process run, resumes in one process, and leaves no actor or reservation behind."""

import pytest
import torch

from tests.helpers.batches import skewed_batch, skewed_config
from tests.helpers.configs import CHECKPOINTED_PPO
from unipg.checkpoint.files import load_checkpoint
from unipg.checkpoint.store import CheckpointStore
from unipg.config import load_config
from unipg.learn.distributed import load_sharded
from unipg.learn.lm import LMBatch, LMLearner
from unipg.learn.sharded import ShardedLMLearner
from unipg.policy.loading import load_lm_policy
from unipg.runtime.lm import train_lm

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")
from unipg.runtime.backends.ray_learner import RayRanks  # noqa: E402  (needs Ray)
from unipg.runtime.backends.ray_setup import connect, disconnect  # noqa: E402

RAY = ("ray.num_cpus=2", "ray.learner_num_cpus=0.5", "ray.rollout_num_cpus=0.5", "ray.rollout_workers=1")
# padded micro-batches of 3 rows, one per rank: exactly one of them repeats a prompt (of grouped_batch)
SETTINGS = (
    "train.micro_batch_size=3",
    "train.num_epochs=1",
    "train.learning_rate=1e-3",
    "train.adam_eps=1e-3",
    "estimator.entropy_coef=0.01",
)


def grouped_batch(seed: int = 0) -> LMBatch:
    """``skewed_batch`` whose first three rows share a prompt, as the samples of a GRPO group do."""
    batch = skewed_batch(seed)
    width = batch.input_ids.shape[1] - batch.completion_mask.shape[1]
    for row in (1, 2):
        batch.input_ids[row, :width] = batch.input_ids[0, :width]
        batch.attention_mask[row, :width] = batch.attention_mask[0, :width]
    return batch


def learner(model_path: str) -> LMLearner:
    torch.manual_seed(0)
    return LMLearner(load_lm_policy(model_path), skewed_config(*SETTINGS))


@pytest.fixture(scope="module")
def local_ray():
    """One local instance (bound to loopback, as a run starts it) for the tests below; runs join it."""
    assert connect(load_config(None, ["task.name=arithmetic", *RAY]).ray)
    yield
    disconnect()


def gone(pids: list[int]) -> bool:
    """Whether every process of ``pids`` has ended, waiting up to 60 s for Ray to reap them."""
    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=60)
    return alive == []


def reservations() -> list[str]:
    return [group["state"] for group in ray.util.placement_group_table().values() if group["state"] != "REMOVED"]


def test_two_ray_learner_actors_update_like_one_process_and_checkpoints_move_between_them(
    local_ray, embedded_path, tmp_path
):
    """One update on 2 actors equals the 1-process update (the ranks run the same passes, whether or not their
    micro-batches repeat a prompt); the actors' sharded checkpoint loads in one process, and a one-process
    checkpoint restored on the actors trains on like the one process."""
    single = learner(embedded_path)
    expected = single.update(grouped_batch())
    torch.manual_seed(0)
    policy = load_lm_policy(embedded_path)
    sharded = ShardedLMLearner(policy, skewed_config(*SETTINGS, *RAY), 2, RayRanks)
    try:
        pids = ray.get([actor.ready.remote() for actor in sharded._ranks.actors])
        metrics = sharded.update(grouped_batch())
        for name, tensor in single.policy.model.state_dict().items():
            assert torch.allclose(policy.model.state_dict()[name], tensor, atol=1e-5), name
        assert metrics["loss"] == pytest.approx(expected["loss"], abs=1e-5)
        assert metrics["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
        state = sharded.state()
        sharded.save_shards(tmp_path)
        policy.load_state_dict(single.policy.state_dict())  # 1 process → 2 actors: the driver's weights first
        sharded.restore(*single.checkpoint())
        sharded.update(grouped_batch(seed=1))
    finally:
        sharded.close()
    resumed = learner(embedded_path)  # 2 actors → 1 process
    load_sharded(tmp_path, resumed.policy, resumed.optimizer, resumed.masters)
    resumed.restore_state(state)
    for parameter, twin in zip(resumed.parameters, single.parameters):
        moments = resumed.optimizer.state[parameter]["exp_avg_sq"], single.optimizer.state[twin]["exp_avg_sq"]
        assert torch.allclose(*moments, atol=1e-9, rtol=1e-3)
    single.update(grouped_batch(seed=1))
    for name, tensor in single.policy.model.state_dict().items():
        assert torch.allclose(policy.model.state_dict()[name], tensor, atol=1e-5), name
    assert gone(pids) and reservations() == []


@pytest.mark.e2e
def test_a_ray_run_with_two_learner_actors_trains_like_one_process_and_resumes_in_one(
    local_ray, embedded_path, tmp_path
):
    def run(name, updates, *overrides, resume=None):
        config = load_config(
            None,
            [
                *CHECKPOINTED_PPO,
                f"model.name={embedded_path}",
                f"log.output_dir={tmp_path}",
                f"log.run_name={name}",
                f"train.updates={updates}",
                *overrides,
            ],
        )
        return train_lm(config, resume=resume)

    single = run("single", 3)
    sharded = run("sharded", 2, "backend=ray", "train.learner_processes=2", *RAY)
    assert [actor for actor in ray.util.list_named_actors() if actor.startswith("unipg-")] == []
    assert reservations() == []
    resumed = run("sharded", 3, resume=sharded.run_dir)
    assert resumed.resumed_from == 2
    expected, got = (
        load_checkpoint(CheckpointStore(result.run_dir / "checkpoints").latest()).tensors
        for result in (single, resumed)
    )
    for group in ("policy", "value_head"):
        for name, tensor in expected[group].items():
            assert torch.allclose(got[group][name], tensor, atol=1e-5), name
