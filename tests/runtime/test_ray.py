"""The Ray backend on a local Ray instance with 2 CPUs: same updates as in-process, workers lost and replaced,
hung environment actors timed out, nothing left running afterwards."""

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.configs import CALCULATOR_AGENT as AGENT
from tests.helpers.configs import DETERMINISTIC_PPO as SMALL
from unipg.config import ConfigError, load_config
from unipg.envs.service import EnvironmentService
from unipg.observe.metrics import read_metrics
from unipg.policy.loading import load_lm_policy
from unipg.runtime.lm import train_lm
from unipg.tools.base import Tool, ToolError

ray = pytest.importorskip("ray")


def ray_processes(marker: str) -> list[str]:
    """Command lines of live processes that mention ``marker`` (a Ray session name)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in line:
                found.append(line[:160])
    return found


SESSION_SCRIPT = """
import sys
import ray
import unipg.runtime.backends.ray_lm as backend
from unipg.cli import main
connect = backend.connect
def spy(settings):
    started = connect(settings)
    print("SESSION", ray.get_runtime_context().get_node_id(), ray._private.worker.global_worker.node.session_name, flush=True)
    return started
backend.connect = spy
sys.argv = ["unipg", "train", *sys.argv[1:]]
main()
"""


@pytest.mark.e2e
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find processes left behind")
def test_a_run_that_starts_ray_leaves_no_process_behind(embedded_path, tmp_path):
    """`unipg train --backend ray` without ray.address starts a local instance and stops it: no actor, raylet or
    worker process of its session outlives the command."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [
        *SMALL,
        "train.updates=2",
        f"model.name={embedded_path}",
        f"log.output_dir={tmp_path}",
        "ray.num_cpus=2",
        "ray.rollout_workers=2",
        "ray.rollout_num_cpus=0.5",
    ]
    done = subprocess.run(
        [sys.executable, "-c", SESSION_SCRIPT, "--backend", "ray", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    session = next(line.split()[2] for line in done.stdout.splitlines() if line.startswith("SESSION"))
    deadline = time.monotonic() + 20
    while ray_processes(session) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray_processes(session) == []
    (run,) = [path for path in tmp_path.iterdir() if path.is_dir()]
    records = [r for r in read_metrics(run) if "train/loss" in r]
    assert [r["step"] for r in records] == [1, 2] and records[-1]["rollout/episodes_finished"] == 16


def test_a_local_instance_too_small_for_the_workers_is_refused_up_front(embedded_path, tmp_path):
    """Asking for more CPUs than a local instance has would wait for resources forever; it is refused instead,
    saying which settings to change, and the instance the run started is stopped again."""
    if ray.is_initialized():
        pytest.skip("needs to start its own instance")
    config = load_config(
        None,
        SMALL
        + [
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            "backend=ray",
            "ray.num_cpus=1",
            "ray.rollout_workers=3",
        ],
    )
    with pytest.raises(ValueError, match=r"needs 3 CPUs, the cluster has 1"):
        train_lm(config)
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def local_ray():
    """One local instance for the tests below, as a user's cluster would be: runs join it and leave it up."""
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


def unipg_actors() -> list[str]:
    return [
        actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True) if actor["name"].startswith("unipg-")
    ]


@pytest.mark.e2e
def test_ray_and_in_process_backends_give_the_same_updates_at_staleness_zero(local_ray, embedded_path, tmp_path):
    """η = 0 with one rollout worker: the generator's state travels to the worker and back, so the samples, the
    losses and the trained weights are those of the in-process run, bit for bit."""
    base = SMALL + [f"model.name={embedded_path}", f"log.output_dir={tmp_path}", "runtime.max_staleness=0"]
    runs = {
        backend: train_lm(load_config(None, base + [f"backend={backend}", "ray.rollout_workers=1"]))
        for backend in ("inprocess", "ray")
    }
    losses = {
        backend: [r["train/loss"] for r in read_metrics(result.run_dir) if "train/loss" in r]
        for backend, result in runs.items()
    }
    assert len(losses["ray"]) == 3 and losses["ray"] == losses["inprocess"]
    weights = {
        backend: load_lm_policy(str(result.run_dir / "policy"), value_head=True).model.state_dict()
        for backend, result in runs.items()
    }
    assert all(torch.equal(weights["ray"][name], value) for name, value in weights["inprocess"].items())
    assert unipg_actors() == []  # a run that joined a cluster leaves no actor of its own on it


@pytest.mark.e2e
def test_a_killed_rollout_worker_is_replaced_and_every_episode_is_accounted_for(
    local_ray, embedded_path, tmp_path, monkeypatch
):
    """`ray.kill` of a rollout worker while it runs groups: training goes on to the last update, the worker is
    replaced, its groups run again, and started = finished + failed + re-queued + cancelled + in flight."""
    import unipg.runtime.backends.ray_lm as backend

    submit, submitted, killed = backend.RayRollout._submit, [], threading.Event()

    def submit_and_kill_at_the_third_group(self, job, worker):
        """The concurrent schedule's third group goes to a worker, which is killed while it holds it."""
        request = submit(self, job, worker)
        if job.state is None:  # a group of the concurrent schedule (not a shard of a sequential step)
            submitted.append(job.order)
            if len(submitted) == 3:
                ray.kill(self.workers[worker])
                killed.set()
        return request

    monkeypatch.setattr(backend.RayRollout, "_submit", submit_and_kill_at_the_third_group)
    config = load_config(
        None,
        AGENT
        + [
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            "backend=ray",
            "runtime.max_staleness=1",
            "runtime.schedule=concurrent",
            "train.updates=5",
            "ray.rollout_workers=2",
            "ray.rollout_num_cpus=0.5",
            "ray.env_workers=1",
            "ray.env_num_cpus=0.1",
        ],
    )
    result = train_lm(config)
    assert killed.is_set()
    records = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    last = records[-1]
    assert last["ray/worker_restarts"] == 1 and last["rollout/episodes_requeued"] >= 4  # at least the group it held
    parts = ["finished", "failed", "requeued", "cancelled", "in_flight"]
    assert last["rollout/episodes_started"] == sum(last[f"rollout/episodes_{part}"] for part in parts)
    assert last["rollout/episodes_failed"] == 0
    assert unipg_actors() == []


@pytest.mark.e2e
def test_a_run_whose_workers_keep_dying_stops_with_a_checkpoint_to_resume_from(
    local_ray, embedded_path, tmp_path, monkeypatch
):
    """Past ray.max_restarts the run stops with an error that says so, after saving a checkpoint of its last
    finished update; `--resume` from it trains to the end."""
    import unipg.runtime.backends.ray_lm as backend

    produce = backend.RayRollout.produce
    calls = []

    def produce_and_kill_at_the_third_step(self, count, version):
        calls.append(version)
        if len(calls) == 3:  # the worker dies while the third step's rollout starts
            ray.kill(self.workers[0])
        return produce(self, count, version)

    monkeypatch.setattr(backend.RayRollout, "produce", produce_and_kill_at_the_third_step)
    config = load_config(
        None,
        SMALL
        + [
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            "backend=ray",
            "ray.rollout_workers=1",
            "ray.max_restarts=0",
            "train.updates=4",
        ],
    )
    with pytest.raises(ValueError) as raised:
        train_lm(config)
    (run_dir,) = [path.parent for path in tmp_path.glob("*/metrics.jsonl")]
    message = str(raised.value)
    assert "more than ray.max_restarts=0" in message
    assert f"a checkpoint of update 2 is in {run_dir}; continue with: unipg train --resume {run_dir}" in message
    assert (run_dir / "checkpoints" / "step-00000002").is_dir()
    assert unipg_actors() == []
    monkeypatch.setattr(backend.RayRollout, "produce", produce)
    resumed = train_lm(load_config(run_dir / "config.yaml", []), resume=run_dir)
    assert resumed.resumed_from == 2 and resumed.updates == 4
    assert [r["step"] for r in read_metrics(run_dir) if "train/loss" in r] == [1, 2, 3, 4]


@pytest.mark.e2e
def test_an_episode_that_raises_on_a_worker_ends_the_run_with_a_one_line_message(
    local_ray, embedded_path, tmp_path, monkeypatch
):
    """A reward function registered in the caller's script runs on the workers too; when it raises there, the run
    stops with the error in one line (no remote traceback) and what to do next."""
    from unipg.tasks.rewards.rules import REWARDS

    driver = os.getpid()

    def fragile(prompts, completions, **columns):
        if os.getpid() != driver:
            raise RuntimeError("reward service unreachable")
        return [0.0] * len(completions)

    monkeypatch.setattr(REWARDS, "_entries", dict(REWARDS._entries))  # registration undone after the test
    REWARDS.register("fragile")(lambda: fragile)
    config = load_config(
        None,
        SMALL
        + [
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            "backend=ray",
            "ray.rollout_workers=1",
            "task.rewards=[{name: fragile}]",
        ],
    )
    with pytest.raises(ValueError) as raised:
        train_lm(config)
    message = str(raised.value)
    assert message.startswith(
        "an episode raised on rollout worker 0: RewardFunctionError: reward function "
        "'fragile' failed: reward service unreachable (RuntimeError); fix the function"
    )
    assert "no update had finished" in message and "Traceback" not in message and "\n" not in message
    assert unipg_actors() == []


def test_a_hanging_environment_actor_is_timed_out_and_restarted(local_ray):
    """A synchronous tool that never returns: the call times out (the episode gets the default observation and
    the failure penalty), the actor whose thread is stuck is restarted, and later calls are answered again."""
    from unipg.runtime.backends.ray_actors import EnvActor, EnvPool

    def hang(seconds: int) -> str:
        time.sleep(seconds)
        return "late"

    def echo(text: str) -> str:
        if not text:
            raise ToolError("nothing to echo")
        return text

    tools = {
        "hang": Tool("hang", "sleeps", {"properties": {"seconds": {"type": "integer"}}}, hang),
        "echo": Tool("echo", "echoes", {"properties": {"text": {"type": "string"}}}, echo),
    }
    actor = ray.remote(EnvActor).options(max_restarts=-1, num_cpus=0).remote(tools)
    ray.get(actor.ready.remote(), timeout=60)
    pool = EnvPool([actor], health_timeout=5.0)
    service = EnvironmentService(tools, timeout=0.5, retries=0, failure_penalty=0.25, remote=pool)

    async def scenario():
        start = time.monotonic()
        hung = await service.call("hang", {"seconds": 3600})
        waited = time.monotonic() - start
        for _ in range(100):  # let the abandon check run (it waits a grace second for the thread)
            await asyncio.sleep(0.1)
            if pool.restarts:
                break
        return hung, waited

    pid = ray.get(actor.ready.remote(), timeout=60)
    hung, waited = asyncio.run(scenario())
    assert hung.status == "failed" and hung.timeouts == 1 and hung.penalty == -0.25
    assert hung.observation == "tool unavailable" and waited < 2.0
    assert pool.restarts == 1
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # Ray starts the actor again, in a new process
        try:
            if ray.get(actor.ready.remote(), timeout=10) != pid:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            time.sleep(0.2)
    retrying = EnvironmentService(tools, timeout=5.0, retries=3, backoff=0.2, remote=pool)
    answered = asyncio.run(retrying.call("echo", {"text": "back"}))
    assert answered.status == "ok" and answered.observation == "back"
    refused = asyncio.run(retrying.call("echo", {"text": ""}))  # a ToolError comes back as the tool's refusal
    assert (refused.status, refused.observation, refused.attempts) == ("error", "error: nothing to echo", 1)
    ray.kill(actor, no_restart=True)


def test_the_ray_backend_is_refused_for_gymnasium_runs():
    with pytest.raises(ConfigError, match="backend 'ray' runs text tasks"):
        load_config(None, ["env.id=CartPole-v1", "backend=ray"])


@pytest.mark.e2e
def test_a_plugin_files_task_tool_and_reward_run_on_the_workers(local_ray, embedded_path, tmp_path):
    """A task, tool and reward defined in a plugin file (`plugins:`) train on Ray: rollout workers and environment
    actors import the plugin before they unpickle what the driver sent them."""
    from tests.helpers.plugins import FAST, write_plugin
    from unipg import api

    plugin = write_plugin(tmp_path, "ray")
    config = api.load_config(
        None,
        overrides=[
            f"plugins=[{plugin}]",
            "task.name=letter_count_ray",
            *FAST,
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            "backend=ray",
            "ray.rollout_workers=1",
            "ray.env_workers=1",
            "ray.env_num_cpus=0.1",
        ],
    )
    result = train_lm(config)
    steps = [record for record in read_metrics(result.run_dir) if "train/loss" in record]
    assert [record["step"] for record in steps] == [1, 2] and "rollout/reward_same_count_ray" in steps[0]
    assert unipg_actors() == []


@pytest.mark.e2e
def test_an_external_agent_trains_on_ray_workers_with_their_own_endpoints(
    local_ray, embedded_path, tmp_path, monkeypatch
):
    """`task.agent` on two rollout workers (concurrent schedule): each worker serves the endpoint on its own
    loopback and runs the agent there. Every trained row holds what the worker's engine sent the agent (the agent
    rewards itself the sum of the log-probs it was sent, over its rewritten history's two trajectories), and the
    agent's counters reach the driver's metrics."""
    import unipg.runtime.lm as lm
    from tests.helpers.configs import EXTERNAL_AGENT_RUN as RUN

    rollout_batch, trained = lm.rollout_batch, []

    def recording(groups, *args, **kwargs):
        trained.extend(t for group in groups for t in group.items)
        return rollout_batch(groups, *args, **kwargs)

    monkeypatch.setattr(lm, "rollout_batch", recording)
    config = load_config(
        None,
        [
            *RUN,
            "task.agent=tests.inference.endpoint.agents_for_tests:reports_its_log_probs",
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            "eval.every_updates=100",
            "backend=ray",
            "ray.rollout_workers=2",
            "ray.rollout_num_cpus=0.5",
            "runtime.max_staleness=1",
            "runtime.schedule=concurrent",
        ],
    )
    result = train_lm(config)
    records = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    assert [r["step"] for r in records] == [1, 2] and [r["train/samples"] for r in records] == [16, 32]
    assert all(
        r["rollout/agent_failures"] == r["rollout/agent_timeouts"] == r["rollout/agent_retries"] == 0 for r in records
    )
    assert sum(r["rollout/agent_extra_trajectories"] for r in records) >= 16  # one per trained episode, at least
    assert len(trained) == 16 and all(t.finish == "done" and len(t.side) == 1 for t in trained)
    for episode in trained:
        rows = [episode, *episode.side]
        sent = [lp for t in rows for lp, sampled in zip(t.behaviour_logprobs, t.loss_mask) if sampled]
        assert sum(t.turns for t in rows) == 3 and sent  # the agent's three calls, each in a row
        assert episode.reward == pytest.approx(sum(sent), rel=1e-9, abs=1e-9)
    assert unipg_actors() == []


def same_multi_role_runs_on_ray_and_in_process(overrides: list[str]) -> dict:
    """Train the solver–checker config with ``overrides`` in-process and on one Ray worker; check that both give the
    same per-role gradient norms and losses and the same checkpoint, bit for bit; returns the Ray run's checkpoint
    tensors by group."""
    from tests.runtime.test_separate_roles_run import CONFIG, latest_tensors

    runs = {
        backend: train_lm(
            load_config(CONFIG, [*overrides, f"backend={backend}", f"log.run_name={backend}"]), log=lambda t: None
        )
        for backend in ("inprocess", "ray")
    }
    steps = {
        backend: [
            (r["train/loss"], r["role/solver/grad_norm"], r["role/checker/grad_norm"])
            for r in read_metrics(run.run_dir)
            if "train/loss" in r
        ]
        for backend, run in runs.items()
    }
    assert len(steps["ray"]) == 2 and steps["ray"] == steps["inprocess"]
    groups = {backend: latest_tensors(run.run_dir) for backend, run in runs.items()}  # weights, optimizer state, ...
    assert groups["ray"].keys() == groups["inprocess"].keys()
    for group, tensors in groups["inprocess"].items():
        assert groups["ray"][group].keys() == tensors.keys(), group
        assert all(torch.equal(groups["ray"][group][name], value) for name, value in tensors.items()), group
    assert unipg_actors() == []
    return groups["ray"]


@pytest.mark.e2e
def test_a_model_per_role_trains_on_ray_workers_as_in_process(local_ray, tmp_path):
    """``agent.role_policy: separate`` on Ray: the worker builds every role's model (a larger solver, a smaller
    checker) and samples each role's turns with its own; at η = 0 with one worker the losses and both roles' trained
    weights are the in-process run's, bit for bit, and both moved from their initial weights."""
    from tests.helpers.configs import tiny_team_overrides
    from tests.runtime.test_separate_roles_run import ROLES, tiny_llama
    from unipg.policy.loading import load_causal_lm

    models = {"solver": tiny_llama(tmp_path / "solver", 64, seed=1), "checker": tiny_llama(tmp_path / "checker", 32, 2)}
    base = tiny_team_overrides(
        "agent.role_policy=separate",
        f"model.name={models['solver']}",
        f"agent.roles.checker.model={models['checker']}",
        f"log.output_dir={tmp_path}",
        "train.updates=2",
        "runtime.max_staleness=0",
        "ray.rollout_workers=1",
    )
    tensors = same_multi_role_runs_on_ray_and_in_process(base)["policy"]
    for role in ROLES:  # each role's model trained away from its initial weights
        initial = load_causal_lm(models[role]).state_dict()
        assert any(not torch.equal(tensors[f"{role}.{name}"], value) for name, value in initial.items()), role
    assert tensors["checker.model.embed_tokens.weight"].shape[1] == 32


@pytest.mark.e2e
def test_an_adapter_per_role_trains_on_ray_workers_as_in_process(local_ray, embedded_path, tmp_path):
    """``agent.role_policy: adapters`` on Ray: the worker receives every role's adapter and samples each role's
    turns with its own, as in-process."""
    from tests.helpers.configs import tiny_team_overrides

    overrides = tiny_team_overrides(
        "agent.role_policy=adapters",
        "model.lora_rank=4",
        f"model.name={embedded_path}",
        f"log.output_dir={tmp_path}",
        "train.updates=2",
        "runtime.max_staleness=0",
        "ray.rollout_workers=1",
    )
    assert "optimizer" in same_multi_role_runs_on_ray_and_in_process(overrides)  # each role's AdamW state, equal


@pytest.mark.e2e
def test_a_model_per_role_trains_on_two_ray_workers_with_staleness(local_ray, tmp_path):
    """The concurrent schedule on two workers: each worker holds every role's model, receives both roles' weights
    by version, and the learner trains both roles from their own rows."""
    from tests.helpers.configs import tiny_team_overrides
    from tests.runtime.test_separate_roles_run import CONFIG, ROLES, tiny_llama

    models = {"solver": tiny_llama(tmp_path / "solver", 64, seed=1), "checker": tiny_llama(tmp_path / "checker", 32, 2)}
    overrides = tiny_team_overrides(
        "agent.role_policy=separate",
        f"model.name={models['solver']}",
        f"agent.roles.checker.model={models['checker']}",
        f"log.output_dir={tmp_path}",
        "train.updates=3",
        "runtime.max_staleness=1",
        "deterministic=false",
        "backend=ray",
        "ray.rollout_workers=2",
        "ray.rollout_num_cpus=0.5",
    )
    result = train_lm(load_config(CONFIG, overrides), log=lambda t: None)
    steps = [record for record in read_metrics(result.run_dir) if "train/loss" in record]
    assert len(steps) == 3
    for role in ROLES:
        assert all(record[f"role/{role}/grad_norm"] > 0 for record in steps), role
    assert unipg_actors() == []
