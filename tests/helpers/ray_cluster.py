"""A Ray cluster of several nodes on this machine: each node a real `ray start` process tree of its own (GCS on
the head, a raylet and its workers on every node), bound to 127.0.0.1, in a temporary folder of its own, stopped
again with ``stop`` (those processes only: no other Ray on the machine is touched).

Ray replaces a loopback node address by the machine's own, and refuses to add a node when clusters are disabled
(the switch ``unipg.runtime.backends.ray_setup.connect`` uses for a local instance), so every node is started by a
small launcher that keeps loopback addresses as they are and then runs Ray's own command line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

# Runs Ray's `ray` command with loopback addresses left as they are (not resolved to the machine's address).
LAUNCHER = """
import sys
from ray._private import services
from ray.scripts.scripts import main

services.resolve_ip_for_localhost = lambda host: host
sys.argv = ["ray", *sys.argv[1:]]
main()
"""

LOOPBACK = "127.0.0.1"
OBJECT_STORE_BYTES = 100 * 1024 * 1024  # per node; Ray would otherwise reserve 30% of the machine's memory
POLL_SECONDS = 0.2  # between two looks at the cluster while waiting for it


@dataclass
class Node:
    """One `ray start` of the cluster: its CPUs, its custom resources, and (once started) its temporary folder and
    the id of the process group its own processes share (the workers its raylet starts have groups of their own);
    its Ray node id once ``wait_for_nodes`` has seen it."""

    num_cpus: float
    resources: dict[str, float] = field(default_factory=dict)
    temp_dir: Path | None = None
    process_group: int | None = None
    node_id: str | None = None


class LoopbackCluster:
    """A head node and worker nodes, started together by ``start`` (within ``start_timeout`` seconds: a worker
    node waits for the head); ``address`` is the head's GCS address, which ``ray.init`` and ``ray.address`` join.
    With ``dashboard`` the head also serves Ray's dashboard and job server (`ray job submit --address`) at
    ``dashboard_url`` on 127.0.0.1 (it needs the packages of ``ray[default]``). Its processes join the cluster
    with ``ray.init`` (the dashboard's agent, a job's driver), which on Linux replaces a loopback address by the
    machine's own unless clusters are disabled (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``), so the head runs with them
    disabled: only a `ray start` that joins a head refuses to run so, and worker nodes run without it."""

    def __init__(self, head: Node, *workers: Node, start_timeout: float = 120.0, dashboard: bool = False):
        self.nodes = [head, *workers]
        self.start_timeout = start_timeout
        self.dashboard = dashboard
        self.address: str | None = None
        self.dashboard_url: str | None = None

    def start(self) -> str:
        """Start every node; the head's address."""
        self.address = f"{LOOPBACK}:{free_loopback_port()}"
        head, *workers = self.nodes
        head_role = ["--head", f"--port={self.address.rpartition(':')[2]}", "--include-dashboard=false"]
        if self.dashboard:
            port = free_loopback_port()
            self.dashboard_url = f"http://{LOOPBACK}:{port}"
            head_role[2:] = ["--include-dashboard=true", f"--dashboard-host={LOOPBACK}", f"--dashboard-port={port}"]
        roles = [head_role]
        roles += [[f"--address={self.address}"] for _ in workers]
        launchers = [self._launch(node, role, head=role is head_role) for node, role in zip(self.nodes, roles)]
        deadline = time.monotonic() + self.start_timeout
        for role, launcher in zip(roles, launchers):
            try:
                output, _ = launcher.communicate(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                self.stop()
                raise RuntimeError(f"`ray start {role[0]}` did not finish within {self.start_timeout:g} s") from None
            if launcher.returncode != 0:
                self.stop()
                raise RuntimeError(f"`ray start {role[0]}` failed:\n{output[-3000:]}")
        return self.address

    def _launch(self, node: Node, role: list[str], *, head: bool) -> subprocess.Popen:
        node.temp_dir = Path(tempfile.mkdtemp(prefix="unipg-ray-"))  # short: Ray's sockets live under it
        command = [
            sys.executable,
            "-c",
            LAUNCHER,
            "start",
            *role,
            f"--node-ip-address={LOOPBACK}",
            f"--num-cpus={node.num_cpus:g}",
            f"--resources={json.dumps(node.resources)}",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            f"--temp-dir={node.temp_dir}",
            "--disable-usage-stats",
        ]
        # token authentication off on every node: a worker node does not read the token a head may have picked up,
        # and every server of the cluster listens on loopback only
        environment = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
        if head and self.dashboard:
            environment["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        launcher = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=environment,
            start_new_session=True,  # the node's processes share the launcher's process group, and only they do
        )
        node.process_group = launcher.pid
        return launcher

    def wait_for_nodes(self, nodes) -> dict[str, str]:
        """Poll ``nodes`` (``ray.nodes`` of a driver connected to the cluster) until every node of the cluster is
        alive, at most ``start_timeout`` seconds, and note each node's id (``Node.node_id``: the node whose object
        store's socket is in its temporary folder); the node id of each custom resource's node."""
        deadline = time.monotonic() + self.start_timeout
        while True:
            alive = [node for node in nodes() if node["Alive"]]
            if len(alive) == len(self.nodes):
                for node in self.nodes:
                    node.node_id = next(
                        entry["NodeID"]
                        for entry in alive
                        if entry["ObjectStoreSocketName"].startswith(f"{node.temp_dir}{os.sep}")
                    )
                return {name: node["NodeID"] for node in alive for name in node["Resources"] if not _builtin(name)}
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(alive)} of the cluster's {len(self.nodes)} nodes alive after the deadline")
            time.sleep(POLL_SECONDS)

    def kill(self, index: int) -> list[int]:
        """Lose node ``index`` as a machine is lost: SIGKILL every process of it (its raylet, the workers the raylet
        started, the actors on it), no `ray stop`, and wait up to ``start_timeout`` seconds for them to end; the pids
        killed. The rest of the cluster learns of it as of a lost machine, by its health checks."""
        node = self.nodes[index]
        killed = _kill(node_processes(node.process_group)) if node.process_group is not None else []
        node.process_group = None
        _wait_until_ended(killed, self.start_timeout)
        return killed

    def stop(self) -> list[int]:
        """What `ray stop --force` does, for this cluster's processes only: kill every process of each node (its
        process group, and the workers its raylet started, which have groups of their own), remove the nodes'
        temporary folders, and wait up to ``start_timeout`` seconds for the processes to end; those still alive."""
        killed = []
        for node in self.nodes:
            if node.process_group is not None:
                killed += _kill(node_processes(node.process_group))
                node.process_group = None
            if node.temp_dir is not None:
                shutil.rmtree(node.temp_dir, ignore_errors=True)
                node.temp_dir = None
        return _wait_until_ended(killed, self.start_timeout)


class StubRank:
    """A stand-in for a learner rank's actor, quick to start (this module imports no torch): it answers ``call`` at
    once, or never (``stuck``: it waits for an event that no one sets, until it is killed)."""

    def __init__(self, stuck: bool):
        self.stuck, self.never = stuck, threading.Event()

    def ready(self) -> bool:
        return True

    def call(self, name: str, arguments) -> str:
        if self.stuck:
            self.never.wait()
        return name


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now (the head's GCS takes it a moment later)."""
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


def _kill(pids: list[int]) -> list[int]:
    """SIGKILL each of ``pids``; those it reached (the others ended meanwhile)."""
    killed = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    return killed


def _wait_until_ended(pids: list[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` seconds for ``pids`` to end; those still alive."""
    deadline = time.monotonic() + timeout
    while (alive := [pid for pid in pids if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)
    return alive


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie has ended; so has a process /proc no longer lists)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _builtin(resource: str) -> bool:
    """Whether ``resource`` is one Ray gives every node (CPUs, memory, the node's own address)."""
    return resource in ("CPU", "GPU", "memory", "object_store_memory") or resource.startswith("node:")


def node_processes(group: int) -> list[int]:
    """Pids of the live processes of process group ``group`` and of their descendants (read from /proc)."""
    parents, groups = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                state, parent, process_group = stat.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # it ended while we looked
        if state != "Z":
            parents[int(entry)], groups[int(entry)] = int(parent), int(process_group)
    found = {pid for pid, member_of in groups.items() if member_of == group}
    while grown := {pid for pid, parent in parents.items() if parent in found} - found:
        found |= grown
    return sorted(found)
