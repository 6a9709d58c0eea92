"""Starting the Ray backend's cluster side (``unipg.runtime.backends.ray_lm``, ``ray_learner``): connecting to
Ray, checking its resources, placing and starting the rollout workers and environment actors, waiting until
they answer.

Every start has a timeout (``ray.start_timeout``); an actor that cannot start is a ``ValueError`` that says why.
"""

from __future__ import annotations

import logging
import os

from ray.exceptions import GetTimeoutError, RayActorError

from unipg.config import Config
from unipg.config.devices import resolve_device
from unipg.runtime.backends.ray_actors import (  # says how to install Ray if it is missing
    EnvActor,
    RolloutWorker,
    ray,
)
from unipg.runtime.setup import check_ray_address

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
    # object manager, workers) would listen on every interface. Only with clusters disabled (Ray's macOS/Windows
    # mode, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before Ray is imported) is the node 127.0.0.1, and every server then
    # binds to loopback. The flag is private and read when ray.init picks the node address, so it is switched for
    # this call only; tests/runtime/test_exposure.py notices if a Ray release stops honouring it.
    try:
        from ray._private import ray_constants
    except ImportError:
        ray_constants = None
    clusters = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    local = settings.address is None and not os.environ.get("RAY_ADDRESS")  # RAY_ADDRESS: ray.init joins it
    if local and clusters is not None:
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
    """Whether the cluster has the CPUs and GPUs the configured actors ask for (``learner``: the bundles of a
    sharded learner's ranks, ``learner_bundles``): a ``ValueError`` if not on a ``local`` instance
    (it cannot grow); a warning on a cluster, which may still grow within ``ray.start_timeout``."""
    need = (
        settings.rollout_workers * settings.rollout_num_cpus
        + tools * settings.env_workers * settings.env_num_cpus
        + sum(bundle["CPU"] for bundle in learner)
    )
    gpus = settings.rollout_workers * settings.rollout_num_gpus + sum(bundle.get("GPU", 0) for bundle in learner)
    have = ray.cluster_resources()
    short = [
        f"{need:g} CPUs, the cluster has {have.get('CPU', 0):g}" if need > have.get("CPU", 0) else "",
        f"{gpus:g} GPUs, the cluster has {have.get('GPU', 0):g}" if gpus > have.get("GPU", 0) else "",
    ]
    short = [text for text in short if text]
    if short:
        ranks = " + train.learner_processes × ray.learner_num_cpus (a GPU each on a GPU device)" if learner else ""
        message = (
            f"the Ray backend needs {' and '.join(short)} (ray.rollout_workers × ray.rollout_num_cpus/gpus "
            f"+ ray.env_workers × ray.env_num_cpus{ranks}); lower them, or raise ray.num_cpus"
        )
        if local:
            raise ValueError(message)
        log(f"warning: {message} — waiting up to ray.start_timeout for the cluster to grow")


def place(settings):
    """A ready placement group of one bundle per rollout worker (``ray.placement``: pack or spread)."""
    bundle = {"CPU": settings.rollout_num_cpus} | (
        {"GPU": settings.rollout_num_gpus} if settings.rollout_num_gpus else {}
    )
    return reserve([bundle] * settings.rollout_workers, settings.placement, "rollout workers", settings.start_timeout)


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
                num_cpus=settings.env_num_cpus, max_restarts=-1, max_concurrency=1000, name=f"unipg-env-{run_id}-{i}"
            ).remote(tools)
        )
    wait_ready(actors, "environment actor", settings.start_timeout)


def start_worker(settings, setup, index: int, env_actors: list, placement, name: str):
    """Start rollout worker ``index`` (named ``name``) from the object reference ``setup``, in its bundle of
    ``placement`` if there is one; it answers ``ready`` once it has built its policy and engine."""
    options = {
        "num_cpus": settings.rollout_num_cpus,
        "num_gpus": settings.rollout_num_gpus,
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


def wait_ready(actors: list, role: str, start_timeout: float) -> None:
    """Wait until every one of ``actors`` answers, at most ``start_timeout`` seconds; a ``ValueError`` saying why
    not."""
    try:
        ray.get([actor.ready.remote() for actor in actors], timeout=start_timeout)
    except GetTimeoutError:
        raise ValueError(
            f"a {role} did not start within ray.start_timeout={start_timeout:g} s; "
            "the cluster may lack the resources it asks for (ray.*_num_cpus, ray.*_num_gpus)"
        ) from None
    except RayActorError as error:
        first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise ValueError(
            f"a {role} failed to start: {first} (its traceback is in the Ray logs, /tmp/ray/session_latest/logs)"
        ) from None


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
    """The placement group's bundles: one per rank, with a GPU each on a GPU device."""
    bundle = {"CPU": config.ray.learner_num_cpus}
    if resolve_device(config.device).type == "cuda":
        bundle["GPU"] = 1
    return [dict(bundle) for _ in range(world_size)]
