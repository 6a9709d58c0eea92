"""A whole node of a Ray cluster lost mid-run (tests/helpers/ray_cluster.py: real nodes on 127.0.0.1, one of them
killed hard, its raylet and workers at once, as when a machine is lost), after update 1's checkpoint, while the
run's rollout worker lives on it. Each case starts a cluster of its own: the lost node does not come back.

When another node has what a rollout worker asks for, the worker is replaced there, its episodes run again and the
run trains to the end with every episode counted once; when none has, the run stops, once Ray has declared the node
dead, with a checkpoint of update 1 and a one-line error naming the node."""

from pathlib import Path

import pytest

from tests.helpers.configs import DETERMINISTIC_PPO as SMALL
from unipg.config import load_config
from unipg.observe.metrics import read_metrics
from unipg.runtime.lm import train_lm

ray = pytest.importorskip("ray")
from tests.helpers.ray_cluster import LoopbackCluster, Node  # noqa: E402  (needs Ray)
from unipg.runtime.backends.ray_lm import RayRollout  # noqa: E402
from unipg.runtime.backends.ray_setup import connect, disconnect  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the nodes' processes in /proc"),
    pytest.mark.e2e,
]

EPISODES_PER_UPDATE = 8  # two prompts × four samples (tests/helpers/configs.py)


@pytest.fixture
def cluster_of(request):
    """``cluster_of(*nodes)``: a started ``LoopbackCluster`` (the first node its head), joined as a run joins it,
    with each node's id noted; its processes end with the test."""
    started = []

    def start(*nodes: Node) -> LoopbackCluster:
        cluster = LoopbackCluster(*nodes)
        started.append(cluster)
        address = cluster.start()
        assert connect(load_config(None, ["task.name=arithmetic", f"ray.address={address}"]).ray)
        cluster.wait_for_nodes(ray.nodes)
        return cluster

    yield start
    if ray.is_initialized():
        disconnect()
    for cluster in started:
        assert cluster.stop() == []  # every process of every node has ended


def kill_the_workers_node_after_update_1(monkeypatch, cluster: LoopbackCluster) -> list[str]:
    """Make the second step's rollout (after update 1 and its checkpoint) begin by killing the node that hosts
    rollout worker 0; the ids of the nodes killed."""
    produce, killed = RayRollout.produce, []

    def kill_then_produce(self, count, version):
        if version == 1 and not killed:
            node_id = self.placed(0)["node_id"]
            killed.append(node_id)
            index = next(i for i, node in enumerate(cluster.nodes) if node.node_id == node_id)
            assert index > 0 and cluster.kill(index)
        return produce(self, count, version)

    monkeypatch.setattr(RayRollout, "produce", kill_then_produce)
    return killed


def run_config(cluster: LoopbackCluster, embedded_path: str, tmp_path):
    return load_config(
        None,
        SMALL
        + [
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            "backend=ray",
            f"ray.address={cluster.address}",
            "ray.rollout_workers=1",
            "ray.rollout_num_cpus=0.5",
            "ray.rollout_resources={rollout: 1}",
            "train.updates=2",
            "checkpoint.every_updates=1",
        ],
    )


def test_a_lost_node_s_worker_is_replaced_on_another_node_and_every_episode_counts_once(
    cluster_of, embedded_path, tmp_path, monkeypatch
):
    # two nodes with one `rollout` each: the worker runs on one of them, and its replacement can only go to the other
    cluster = cluster_of(Node(1, {"learner": 1}), Node(1, {"rollout": 1}), Node(1, {"rollout": 1}))
    killed = kill_the_workers_node_after_update_1(monkeypatch, cluster)
    close, placed = RayRollout.close, []

    def record_where_the_worker_ran(self):
        placed.append(self.placed(0))
        close(self)

    monkeypatch.setattr(RayRollout, "close", record_where_the_worker_ran)
    result = train_lm(run_config(cluster, embedded_path, tmp_path))
    (node_id,) = killed
    assert placed[0] is not None and {placed[0]["node_id"], node_id} == {node.node_id for node in cluster.nodes[1:]}
    records = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    assert [r["step"] for r in records] == [1, 2]
    last = records[-1]
    assert last["ray/worker_restarts"] >= 1
    # the step's shard ran again, whole, on the replacement: trained once, none lost
    assert last["rollout/episodes_finished"] == 2 * EPISODES_PER_UPDATE
    assert last["rollout/episodes_requeued"] >= EPISODES_PER_UPDATE
    assert last["rollout/episodes_failed"] == last["rollout/episodes_in_flight"] == 0
    parts = ["finished", "failed", "requeued", "cancelled", "in_flight"]
    assert last["rollout/episodes_started"] == sum(last[f"rollout/episodes_{part}"] for part in parts)


def test_a_lost_node_no_other_node_can_replace_stops_the_run_naming_it_with_a_checkpoint(
    cluster_of, embedded_path, tmp_path, monkeypatch
):
    cluster = cluster_of(Node(1, {"learner": 1}), Node(1, {"rollout": 1}))
    killed = kill_the_workers_node_after_update_1(monkeypatch, cluster)
    with pytest.raises(ValueError) as raised:
        train_lm(run_config(cluster, embedded_path, tmp_path))
    (node_id,) = killed
    assert node_id == cluster.nodes[1].node_id
    (run_dir,) = [path.parent for path in tmp_path.glob("*/metrics.jsonl")]
    message = str(raised.value)
    assert message.startswith("rollout worker 0 (actor unipg-rollout-") and "\n" not in message
    assert f"was lost with its node {node_id[:12]} at 127.0.0.1, which died" in message
    assert "no node left in the cluster has what a rollout worker asks for ({'CPU': 0.5, 'rollout': 1.0})" in message
    assert f"a checkpoint of update 1 is in {run_dir}; continue with: unipg train --resume {run_dir}" in message
    assert (run_dir / "checkpoints" / "step-00000001").is_dir()
    assert [r["step"] for r in read_metrics(run_dir) if "train/loss" in r] == [1]
