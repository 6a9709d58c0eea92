"""``backend: ray`` with ``train.learner_processes`` = N > 1: the sharded learner's N ranks as Ray actors.

The ranks are reserved together in one placement group, a bundle per rank (``{"CPU": ray.learner_num_cpus}``,
plus one GPU each when the run's device is a GPU, plus ``ray.learner_resources``), packed on as few machines as
possible or spread over as many (``ray.learner_placement``). Rank 0 picks its rendezvous address from inside its actor (its node's IP
address and a free port there) and every rank joins the process group at it: gloo on CPU, NCCL on GPU. Each
actor runs the same ``LearnerRank`` as a local process (``unipg.learn.sharded``); only how the ranks are started
and talked to differs: every driver call goes to all actors at once with one object-store copy of its
arguments, and rank 0's answer comes back once every rank has answered, within ``ray.call_timeout``.

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
    await_actors,
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
        self.actors, self.placement, self.names = [], None, []
        self.call_timeout = settings.call_timeout
        try:
            bundles = learner_bundles(config, world_size)
            if self.connected and settings.address is None:  # a local instance cannot grow: refuse now
                check_resources(settings, tools=False, local=True, log=print, learner=bundles)
            self.placement = reserve(bundles, settings.learner_placement, "learner ranks", settings.start_timeout)
            if resolve_device(config.device).type == "cuda":  # each actor sees only its own GPU
                config = config.model_copy(update={"device": "cuda"})
            run_id, inputs = uuid.uuid4().hex[:8], (ray.put(config), ray.put(weights))
            gpus = bundles[0].get("GPU", 0)
            resources = {name: amount for name, amount in bundles[0].items() if name not in ("CPU", "GPU")}
            for rank in range(world_size):
                options = {
                    "num_cpus": bundles[rank]["CPU"],
                    "num_gpus": gpus,
                    "resources": resources,
                    "max_restarts": 0,
                    "name": f"unipg-learner-{run_id}-{rank}",
                    **in_bundle(self.placement, rank),
                }
                self.actors.append(ray.remote(LearnerActor).options(**options).remote(rank, world_size, *inputs))
            self.names = [f"learner rank {rank} (unipg-learner-{run_id}-{rank})" for rank in range(world_size)]
            wait_ready([actor.ready.remote() for actor in self.actors], self.names, settings.start_timeout)
            host, port = await_actors(
                [self.actors[0].rendezvous.remote()],
                self.names[:1],
                action="name the rendezvous address",
                timeout=settings.start_timeout,
                setting="ray.start_timeout",
                hint="its node may be overloaded",
            )[0]
            await_actors(
                [actor.start.remote(host, port) for actor in self.actors],
                self.names,
                action="join the process group",
                timeout=settings.start_timeout,
                setting="ray.start_timeout",
                hint=f"the ranks could not all join it at {host}:{port}; on a cluster, let the machines reach each "
                "other on it (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME pick the network interface)",
            )
        except BaseException:
            self.close()
            raise

    def call(self, name: str, *args):
        """Rank 0's value once every rank has answered, at most ``ray.call_timeout`` seconds; a ``RuntimeError``
        naming the ranks that did not answer in time, or the first that died or raised."""
        arguments = ray.put(args) if args else ()
        return await_actors(
            [actor.call.remote(name, arguments) for actor in self.actors],
            self.names,
            action=f"finish '{name}'",
            timeout=self.call_timeout,
            setting="ray.call_timeout",
            hint="a rank may wait in a collective for a peer that is stuck, or the step may need longer (raise "
            "ray.call_timeout); the Ray logs of each rank's node say what it was doing",
            error=RuntimeError,
        )[0]

    def close(self) -> None:
        """Kill the actors (their process group goes with them: a rank may be stuck in a collective a failed
        peer left), free their reservation, and let go of the Ray connection."""
        release(self.actors, self.placement)
        self.actors, self.placement = [], None
        if self.connected:
            disconnect()
            self.connected = False
