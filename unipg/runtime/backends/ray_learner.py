"""``backend: ray`` with ``train.learner_processes`` = N > 1: the sharded learner's N ranks as Ray actors.

The ranks are reserved together in one placement group, a bundle per rank (``{"CPU": ray.learner_num_cpus}``,
plus one GPU each when the run's device is a GPU), packed on as few machines as possible or spread over as
many (``ray.learner_placement``). Rank 0 picks its rendezvous address from inside its actor (its node's IP
address and a free port there) and every rank joins the process group at it: gloo on CPU, NCCL on GPU. Each
actor runs the same ``LearnerRank`` as a local process (``unipg.learn.sharded``); only how the ranks are started
and talked to differs: every driver call goes to all actors at once with one object-store copy of its
arguments, and rank 0's answer comes back.

The driver's handle (``ShardedLMLearner``) loads the weights rank 0 sends after each update into the driver's
policy, so the rollout workers receive them exactly as with a learner in the driver's process
(``RayRollout.publish``: one ``ray.put`` per version, the LoRA adapter alone for an adapter).
"""

from __future__ import annotations

import os
import uuid

import torch

from unipg.config import Config
from unipg.config.devices import resolve_device
from unipg.learn.distributed import free_port
from unipg.learn.sharded import LearnerRank
from unipg.runtime.backends.ray_actors import ray  # says how to install Ray if it is missing
from unipg.runtime.backends.ray_setup import (
    check_resources,
    connect,
    disconnect,
    in_bundle,
    learner_bundles,
    release,
    reserve,
    wait_ready,
)


class LearnerActor(LearnerRank):
    """A ``LearnerRank`` in a Ray actor; rank 0 also names the rendezvous address."""

    def ready(self) -> int:
        return os.getpid()

    def rendezvous(self) -> tuple[str, int]:
        """This node's IP address (as Ray knows it) and a port free on it."""
        host = ray.util.get_node_ip_address()
        return host, free_port(host)


class RayRanks:
    """``unipg.learn.sharded.Ranks`` on Ray actors (module docstring)."""

    def __init__(self, config: Config, world_size: int, weights: dict[str, torch.Tensor]):
        settings = config.ray
        self.connected = connect(settings)  # the run's own connection: the last of its roles disconnects
        self.actors, self.placement = [], None
        try:
            bundles = learner_bundles(config, world_size)
            if self.connected and settings.address is None:  # a local instance cannot grow: refuse now
                check_resources(settings, tools=False, local=True, log=print, learner=bundles)
            self.placement = reserve(bundles, settings.learner_placement, "learner ranks", settings.start_timeout)
            if resolve_device(config.device).type == "cuda":  # each actor sees only its own GPU
                config = config.model_copy(update={"device": "cuda"})
            run_id, inputs = uuid.uuid4().hex[:8], (ray.put(config), ray.put(weights))
            gpus = bundles[0].get("GPU", 0)
            for rank in range(world_size):
                options = {
                    "num_cpus": bundles[rank]["CPU"],
                    "num_gpus": gpus,
                    "max_restarts": 0,
                    "name": f"unipg-learner-{run_id}-{rank}",
                    **in_bundle(self.placement, rank),
                }
                self.actors.append(ray.remote(LearnerActor).options(**options).remote(rank, world_size, *inputs))
            wait_ready(self.actors, "learner rank", settings.start_timeout)
            host, port = ray.get(self.actors[0].rendezvous.remote(), timeout=settings.start_timeout)
            self._wait(
                [actor.start.remote(host, port) for actor in self.actors],
                "start",
                settings.start_timeout,
                hint=f"the ranks could not all join the process group at {host}:{port}; on a cluster, let the "
                "machines reach each other on it (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME pick the "
                "network interface)",
            )
        except BaseException:
            self.close()
            raise

    def call(self, name: str, *args):
        arguments = ray.put(args) if args else ()
        return self._wait([actor.call.remote(name, arguments) for actor in self.actors], name)

    def _wait(self, refs: list, name: str, timeout: float | None = None, hint: str = ""):
        """Rank 0's value once every rank has answered; the first rank that fails ends the wait, and so does
        ``timeout`` seconds without an answer (a ``ValueError`` with ``hint``)."""
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not done:
                raise ValueError(
                    f"the learner ranks did not finish '{name}' within ray.start_timeout={timeout:g} s: {hint}"
                )
            try:
                ray.get(done)
            except Exception as error:  # noqa: BLE001 — a RayTaskError or a lost actor, said in one line
                first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
                raise RuntimeError(
                    f"the sharded learner failed in '{name}' on a Ray actor: {first} (its "
                    "traceback is in the Ray logs, /tmp/ray/session_latest/logs)"
                ) from None
        return ray.get(refs[0])

    def close(self) -> None:
        """Kill the actors (their process group goes with them: a rank may be stuck in a collective a failed
        peer left), free their reservation, and let go of the Ray connection."""
        release(self.actors, self.placement)
        self.actors, self.placement = [], None
        if self.connected:
            disconnect()
            self.connected = False
