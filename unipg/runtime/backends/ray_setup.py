"""Starting the Ray backend's cluster side (``unipg.runtime.backends.ray_lm``, ``ray_learner``): connecting to
Ray (a local instance, or a cluster, one whose nodes listen on loopback included), checking its resources (CPUs,
GPUs, the custom resources of ``ray.*_resources``), placing and starting the rollout workers and environment
actors, waiting until they answer.

Every wait on actors has a timeout (``await_actors``: ``ray.start_timeout`` for a start); an actor that does not
answer in time, dies or raises is an error that names it and says where to look.
"""

from __future__ import annotations

import logging
import os
import socket
import time

from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from unipg.config import Config
from unipg.config.devices import resolve_device
from unipg.runtime.backends.ray_actors import (  # says how to install Ray if it is missing
    EnvActor,
    RolloutWorker,
    ray,
)
from unipg.runtime.setup import RAY_CONNECT_TIMEOUT, check_ray_address

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
LOGS = "<ray temp dir>/session_latest/logs, /tmp/ray by default"  # where each node keeps its processes' logs
# what to look at when an actor's process is gone
LOST_ACTOR_HINT = (
    "check with `ray status` that its node is still alive, and in the Ray logs of that node why the process ended "
    f"(killed, out of memory: {LOGS})"
)
PLURALS = {"CPU": "CPUs", "GPU": "GPUs"}  # Ray's own resources, as a message names them
_holders = 0  # roles of this process's run holding the connection the run made (the last one disconnects)


def connect(settings) -> bool:
    """Join the configured Ray cluster or start a local instance, unless this process is connected already;
    whether the connection is the run's own (and the caller must ``disconnect``). A connection made by someone
    else (a notebook that called ``ray.init``) is used and left open."""
    global _holders
    if ray.is_initialized():
        if _holders:  # made by another role of this run (the learner's ranks, the rollout workers)
            _holders += 1
        return bool(_holders)
    check_ray_address(settings.address)  # ray.init would retry an address where nothing listens for minutes
    options = {
        "runtime_env": settings.runtime_env,
        "logging_level": logging.WARNING,
        "configure_logging": True,
        "log_to_driver": True,
    }
    if settings.address is None:
        options.update(num_cpus=settings.num_cpus, include_dashboard=settings.dashboard, dashboard_host="127.0.0.1")
    else:
        options["address"] = settings.address
    # Ray replaces a loopback node address by the machine's own, so the servers of a local instance (GCS, raylet,
    # object manager, workers) would listen on every interface, and a cluster whose nodes listen on loopback only
    # would be looked for where nothing answers. Only with clusters disabled (Ray's macOS/Windows mode,
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before Ray is imported) does a loopback address stay one. The flag is
    # private and read when ray.init picks the node address, so it is switched for this call only;
    # tests/runtime/test_exposure.py and ray_cluster_cases.py notice if a Ray release stops honouring it.
    try:
        from ray._private import ray_constants
    except ImportError:
        ray_constants = None
    clusters = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    if clusters is not None and keeps_loopback(settings.address or os.environ.get("RAY_ADDRESS")):
        ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(**options)
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise ValueError(
            f"cannot connect to Ray at ray.address={settings.address!r}: {error}; start the cluster "
            "(`ray start --head`) or leave ray.address unset for a local instance"
        ) from None
    finally:
        if clusters is not None:
            ray_constants.ENABLE_RAY_CLUSTER = clusters
    _holders = 1
    return True


def keeps_loopback(address: str | None) -> bool:
    """Whether ``ray.init`` must keep a loopback node address as it is: for a local instance (None: its servers
    then bind to 127.0.0.1 only), and for a cluster at a loopback ``host:port`` that does not answer at this
    machine's own address (its nodes were started with ``--node-ip-address 127.0.0.1``), where Ray would look for
    it. A cluster that answers at both is joined as Ray joins it."""
    if address is None:
        return True
    host, _, port = address.rstrip("/").rpartition(":")
    if address.startswith("ray://") or not port.isdigit() or host.strip("[]") not in LOOPBACK_HOSTS:
        return False
    try:
        from ray._private.services import node_ip_address_from_perspective

        own = node_ip_address_from_perspective()
    except (ImportError, OSError):
        return True  # no address of this machine to compare with: loopback is all there is
    try:
        socket.create_connection((own, int(port)), timeout=RAY_CONNECT_TIMEOUT).close()
    except OSError:
        return True
    return False


def disconnect() -> None:
    """Let go of a connection ``connect`` said was the run's own; the last role to let go disconnects (which
    stops a local instance the run started)."""
    global _holders
    _holders = max(_holders - 1, 0)
    if not _holders:
        ray.shutdown()


def release(actors: list, placement) -> None:
    """Kill ``actors`` (one already gone is skipped: the others must still go) and remove their reservation
    ``placement`` (None: there is none)."""
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 — gone already
            pass
    if placement is not None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(placement)


def check_resources(settings, *, tools: bool, local: bool, log, learner: list[dict] = ()) -> None:
    """Whether the cluster has the CPUs, GPUs and custom resources the configured actors ask for (``learner``: the
    bundles of a sharded learner's ranks, ``learner_bundles``): a ``ValueError`` if not on a ``local`` instance
    (it cannot grow); a warning on a cluster, which may still grow within ``ray.start_timeout``."""
    need: dict[str, float] = {}
    roles = [(settings.rollout_workers, rollout_bundle(settings))]
    if tools:
        roles.append((settings.env_workers, {"CPU": settings.env_num_cpus} | settings.env_resources))
    roles += [(1, bundle) for bundle in learner]
    for count, bundle in roles:
        for name, amount in bundle.items():
            need[name] = need.get(name, 0.0) + count * amount
    have = ray.cluster_resources()
    short = [
        f"{amount:g} {PLURALS.get(name, repr(name))}, the cluster has {have.get(name, 0):g}"
        for name, amount in need.items()
        if amount > have.get(name, 0)
    ]
    if short:
        ranks = " + train.learner_processes × ray.learner_num_cpus (a GPU each on a GPU device)" if learner else ""
        custom = [name for name in need if name not in PLURALS and need[name] > have.get(name, 0)]
        fix = "lower them, or raise ray.num_cpus"
        if custom:
            fix = (
                f"start the nodes that should host them with `ray start --resources '{{\"{custom[0]}\": N}}'`, "
                "or change ray.rollout_resources / env_resources / learner_resources"
            )
        message = (
            f"the Ray backend needs {' and '.join(short)} (ray.rollout_workers × ray.rollout_num_cpus/gpus/resources "
            f"+ ray.env_workers × ray.env_num_cpus/resources{ranks}); {fix}"
        )
        if local:
            raise ValueError(message)
        log(f"warning: {message} — waiting up to ray.start_timeout for the cluster to grow")


def rollout_bundle(settings) -> dict[str, float]:
    """What one rollout worker reserves: its CPUs, GPUs (if any) and custom resources."""
    gpus = {"GPU": settings.rollout_num_gpus} if settings.rollout_num_gpus else {}
    return {"CPU": settings.rollout_num_cpus} | gpus | settings.rollout_resources


def place(settings):
    """A ready placement group of one bundle per rollout worker (``ray.placement``: pack or spread)."""
    return reserve(
        [rollout_bundle(settings)] * settings.rollout_workers,
        settings.placement,
        "rollout workers",
        settings.start_timeout,
    )


def reserve(bundles: list[dict], strategy: str, role: str, start_timeout: float):
    """A placement group of ``bundles`` (``strategy``: pack or spread), once ready; a ``ValueError`` if it is not
    within ``start_timeout`` seconds (the group is then removed)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    placement = placement_group(bundles, strategy=strategy.upper())
    try:
        ray.get(placement.ready(), timeout=start_timeout)
    except GetTimeoutError:
        remove_placement_group(placement)
        raise ValueError(
            f"the placement group of {len(bundles)} {role} ({bundles[0]} each) was not ready within "
            f"ray.start_timeout={start_timeout:g} s: the cluster lacks the resources"
        ) from None
    return placement


def in_bundle(placement, index: int) -> dict:
    """Actor options that start an actor in bundle ``index`` of ``placement``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=index)}


def start_env_actors(settings, tools, run_id: str, actors: list) -> None:
    """Start ``ray.env_workers`` environment actors for ``tools`` into ``actors``, one by one (so that the
    caller can kill those created if one fails), and wait until they answer."""
    actor = ray.remote(EnvActor)
    for i in range(settings.env_workers):
        actors.append(
            actor.options(
                num_cpus=settings.env_num_cpus,
                resources=settings.env_resources,
                max_restarts=-1,
                max_concurrency=1000,
                name=f"unipg-env-{run_id}-{i}",
            ).remote(tools)
        )
    names = [f"environment actor {i} (unipg-env-{run_id}-{i})" for i in range(len(actors))]
    wait_ready([actor.ready.remote() for actor in actors], names, settings.start_timeout)


def start_worker(settings, setup, index: int, env_actors: list, placement, name: str):
    """Start rollout worker ``index`` (named ``name``) from the object reference ``setup``, in its bundle of
    ``placement`` if there is one; it answers ``ready`` once it has built its policy and engine."""
    options = {
        "num_cpus": settings.rollout_num_cpus,
        "num_gpus": settings.rollout_num_gpus,
        "resources": settings.rollout_resources,
        "max_restarts": 0,
        "max_concurrency": 1000,
        "name": name,
    }
    if placement is not None:
        options |= in_bundle(placement, index)
    return (
        ray.remote(RolloutWorker)
        .options(**options)
        .remote(setup, index, env_actors, settings.health_timeout, settings.start_timeout)
    )


def wait_ready(answers: list, names: list[str], start_timeout: float) -> list:
    """Wait until every actor of ``names`` has answered ``ready`` (``answers``: the references of those calls), at
    most ``start_timeout`` seconds; their answers, or a ``ValueError`` saying which did not and why."""
    return await_actors(
        answers,
        names,
        action="start",
        timeout=start_timeout,
        setting="ray.start_timeout",
        hint="the cluster may lack the resources it asks for (ray.*_num_cpus, ray.*_num_gpus, ray.*_resources; "
        "`ray status` lists what each node has)",
    )


def await_actors(
    refs: list, names: list[str], *, action: str, timeout: float, setting: str, hint: str, error=ValueError
):
    """The values of ``refs``, one request to each actor of ``names``, once all have come: at most ``timeout``
    seconds in all (``setting`` says where it is set). Otherwise an ``error`` that names the actors that did not
    ``action`` in time (with ``hint``), or the first that died or raised, in one line."""
    deadline = time.monotonic() + timeout
    pending = dict(zip(refs, names, strict=True))
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
        if not done:
            raise error(f"{', '.join(pending.values())} did not {action} within {setting}={timeout:g} s: {hint}")
        name = pending.pop(done[0])
        try:
            ray.get(done[0], timeout=timeout)  # answered: this returns at once
        except RayActorError as lost:
            if lost.actor_init_failed:  # its constructor raised
                raise error(
                    f"{name} failed to {action}: {last_line(lost)} (its traceback is in the Ray logs of its node, {LOGS})"
                ) from None
            raise error(f"{name} died before it could {action} ({last_line(lost)}): {LOST_ACTOR_HINT}") from None
        except RayTaskError as failed:
            raise error(
                f"{name} failed to {action}: {last_line(failed)} (its traceback is in the Ray logs of its node, {LOGS})"
            ) from None
    return ray.get(refs, timeout=timeout)


def last_line(error: BaseException) -> str:
    """The last non-empty line of ``error``'s message: the exception a remote traceback ends with, or why Ray says an
    actor died."""
    line = next((line.strip() for line in reversed(str(error).splitlines()) if line.strip()), type(error).__name__)
    return line.removesuffix(".")


def start_env_side(config, runner, run_id: str, env_actors: list, *, local: bool, log) -> None:
    """Check that the cluster can host the run (a sharded learner's ranks hold their share already), then start the
    environment actors of a run with tools and ``ray.env_workers`` (appended to ``env_actors`` as they start)."""
    from unipg.config.plugins import imported_first

    settings, ranks = config.ray, config.train.learner_processes
    learner = learner_bundles(config, ranks) if ranks > 1 else []
    check_resources(settings, tools=bool(runner.service), local=local, log=log, learner=learner)
    if runner.service is not None and settings.env_workers:
        start_env_actors(settings, imported_first(config.plugins, runner.service.tools), run_id, env_actors)


def worker_setup(config, runner, task):
    """What every rollout worker is built from: a CPU copy of the policy (a worker moves it to its GPU when given
    one, ``rollout_num_gpus``), the task, config, tools and reward. Built here, so tasks, tools and rewards registered
    in the caller's own script work on workers too (and those of ``plugins``, which workers and environment actors
    import before they unpickle them)."""
    from unipg.config.plugins import imported_first
    from unipg.runtime.backends.local_lm import inference_copy

    tools = runner.service.tools if runner.service is not None else None
    return imported_first(config.plugins, (inference_copy(runner.policy, "cpu"), task, config, tools, runner.reward_fn))


def learner_bundles(config: Config, world_size: int) -> list[dict]:
    """The placement group's bundles: one per rank, with a GPU each on a GPU device and ``ray.learner_resources``."""
    bundle = {"CPU": config.ray.learner_num_cpus}
    if resolve_device(config.device).type == "cuda":
        bundle["GPU"] = 1
    return [bundle | config.ray.learner_resources for _ in range(world_size)]
