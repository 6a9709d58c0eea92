"""The Ray backend on a cluster of two real nodes on this machine (tests/helpers/ray_cluster.py), both on
127.0.0.1: a head with a ``learner`` resource and a second node with a ``rollout`` resource. The driver joins it
at its loopback address; rollout workers that ask for ``rollout`` (``ray.rollout_resources``) run on the second node
and train there. A rollout worker killed there, a learner rank that does not answer in ``ray.call_timeout`` or one
that died, and an actor that no node can host are errors that name the actor (and where it ran)."""

from pathlib import Path

import pytest

from tests.helpers.configs import DETERMINISTIC_PPO as SMALL
from unipg.config import ConfigError, load_config
from unipg.observe.metrics import read_metrics
from unipg.runtime.lm import train_lm

ray = pytest.importorskip("ray")
from tests.helpers.ray_cluster import LoopbackCluster, Node, StubRank  # noqa: E402  (needs Ray)
from unipg.runtime.backends.ray_learner import RayRanks  # noqa: E402
from unipg.runtime.backends.ray_lm import RayRollout  # noqa: E402
from unipg.runtime.backends.ray_setup import (  # noqa: E402
    check_resources,
    connect,
    disconnect,
    keeps_loopback,
    wait_ready,
)

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the nodes' processes in /proc")

ON_THE_ROLLOUT_NODE = ("ray.rollout_num_cpus=0.5", "ray.rollout_resources={rollout: 1}")


@pytest.fixture(scope="module")
def cluster():
    """A head (1 CPU, ``learner``: 1) and a second node (2 CPUs, ``rollout``: 2), joined by this process as a run
    joins them; the node id of each custom resource. Both nodes' processes end with the module."""
    if ray.is_initialized():
        pytest.skip("needs to make its own connection")
    nodes = LoopbackCluster(Node(1, {"learner": 1}), Node(2, {"rollout": 2}))
    try:
        address = nodes.start()
        assert keeps_loopback(address)  # else ray.init would look for the cluster at this machine's own address
        assert connect(load_config(None, ["task.name=arithmetic", f"ray.address={address}"]).ray)
        yield address, nodes.wait_for_nodes(ray.nodes)
    finally:
        if ray.is_initialized():
            disconnect()
        assert nodes.stop() == []  # every process of both nodes has ended


def unipg_actors() -> list[str]:
    return [
        actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True) if actor["name"].startswith("unipg-")
    ]


def run_config(address: str, embedded_path: str, tmp_path, *changes: str):
    return load_config(
        None,
        SMALL
        + [
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            "backend=ray",
            f"ray.address={address}",
            *ON_THE_ROLLOUT_NODE,
            *changes,
        ],
    )


@pytest.mark.e2e
def test_rollout_workers_asking_for_a_custom_resource_train_on_the_node_that_has_it(
    cluster, embedded_path, tmp_path, monkeypatch
):
    address, node_of = cluster
    close, placed = RayRollout.close, []

    def record_where_the_workers_ran(self):
        placed.extend(self.placed(index) for index in range(len(self.workers)))
        close(self)

    monkeypatch.setattr(RayRollout, "close", record_where_the_workers_ran)
    result = train_lm(run_config(address, embedded_path, tmp_path, "ray.rollout_workers=2", "train.updates=2"))
    assert [where["node_id"] for where in placed] == [node_of["rollout"]] * 2
    assert {where["node_ip"] for where in placed} == {"127.0.0.1"}
    records = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    assert [r["step"] for r in records] == [1, 2] and records[-1]["rollout/episodes_finished"] == 16
    assert unipg_actors() == []


@pytest.mark.e2e
def test_a_rollout_worker_killed_on_the_second_node_ends_the_run_with_its_name_and_node(
    cluster, embedded_path, tmp_path, monkeypatch
):
    address, node_of = cluster
    produce = RayRollout.produce

    def kill_the_worker_then_produce(self, count, version):
        ray.kill(self.workers[0])
        return produce(self, count, version)

    monkeypatch.setattr(RayRollout, "produce", kill_the_worker_then_produce)
    config = run_config(address, embedded_path, tmp_path, "ray.rollout_workers=1", "ray.max_restarts=0")
    with pytest.raises(ValueError) as raised:
        train_lm(config)
    message = str(raised.value)
    assert message.startswith("rollout worker 0 (actor unipg-rollout-") and "\n" not in message
    assert f"node {node_of['rollout'][:12]} at 127.0.0.1" in message
    assert "more than ray.max_restarts=0" in message and "`ray status`" in message
    assert unipg_actors() == []


def stub_ranks(call_timeout: float, *stuck: bool) -> RayRanks:
    """``RayRanks`` over one ``StubRank`` per entry of ``stuck`` (on the head, by its ``learner`` resource)."""
    ranks = object.__new__(RayRanks)
    ranks.connected, ranks.placement, ranks.call_timeout = False, None, call_timeout
    actor = ray.remote(StubRank).options(num_cpus=0, resources={"learner": 0.1})
    ranks.actors = [actor.remote(flag) for flag in stuck]
    ranks.names = [f"learner rank {rank} (stub-{rank})" for rank in range(len(stuck))]
    wait_ready([actor.ready.remote() for actor in ranks.actors], ranks.names, start_timeout=120)
    return ranks


def test_a_learner_rank_that_does_not_answer_or_died_is_named_in_the_error(cluster):
    ranks = stub_ranks(3.0, False, True)  # rank 0 answers at once, well within the 3 s
    try:
        with pytest.raises(RuntimeError) as late:
            ranks.call("update", 1)
        assert str(late.value).startswith("learner rank 1 (stub-1) did not finish 'update' within ray.call_timeout=3 s")
        ray.kill(ranks.actors[1])
        with pytest.raises(RuntimeError) as lost:
            ranks.call("update", 2)
        message = str(lost.value)
        assert message.startswith("learner rank 1 (stub-1) died before it could finish 'update' (")
        assert "`ray status`" in message and "\n" not in message
    finally:
        ranks.close()


def test_an_actor_asking_for_a_resource_no_node_has_is_named_when_it_does_not_start_in_time(cluster):
    """On a cluster, which may still grow, such an actor waits for ``ray.start_timeout`` and is then named."""
    actor = ray.remote(StubRank).options(num_cpus=0, resources={"absent": 1}).remote(False)
    try:
        with pytest.raises(ValueError) as late:
            wait_ready([actor.ready.remote()], ["rollout worker 0 (stub)"], start_timeout=2.0)
        message = str(late.value)
        assert message.startswith("rollout worker 0 (stub) did not start within ray.start_timeout=2 s: ")
        assert "ray.*_resources" in message and "`ray status`" in message
    finally:
        ray.kill(actor)


def test_a_custom_resource_no_node_has_is_refused_on_a_local_instance_saying_how_to_add_it(cluster):
    settings = load_config(None, ["task.name=arithmetic", "ray.rollout_resources={gpu_box: 1}"]).ray
    with pytest.raises(ValueError) as refused:
        check_resources(settings, tools=False, local=True, log=print)
    message = str(refused.value)
    assert message.startswith("the Ray backend needs 2 'gpu_box', the cluster has 0 ")
    assert """`ray start --resources '{"gpu_box": N}'`""" in message


@pytest.mark.parametrize(
    "override, says",
    [
        ("ray.rollout_resources={CPU: 1}", "'CPU' is not a custom resource: set ray.rollout_num_cpus instead"),
        ("ray.env_resources={GPU: 1}", "'GPU' is not a custom resource: set ray.rollout_num_gpus instead"),
        ("ray.learner_resources={learner: 0}", "the amount of 'learner' (0) must be a number > 0"),
        ("ray.rollout_resources={rollout: 1.5}", "(1.5) must be a whole number when above 1 (Ray's rule), e.g. 1 or 2"),
        ("ray.rollout_resources={rollout: yes}", "the amount of 'rollout' (True) must be a number > 0"),
    ],
)
def test_custom_resources_that_ray_would_refuse_are_refused_when_the_config_loads(override, says):
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["task.name=arithmetic", override])
    assert says in str(refused.value)
