"""One writer per run folder, released when its process ends however it ends; and a Ray address with nothing
listening is refused before a run folder is made."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.helpers.configs import tiny_lm_overrides
from unipg.cli import app
from unipg.config import load_config
from unipg.runtime.gym import train_gym
from unipg.runtime.lm import train_lm
from unipg.runtime.setup import LOCK_FILE, check_ray_address, lock_run_dir

SMALL = tiny_lm_overrides(
    "train.micro_batch_size=8",
    "train.updates=1",
    "eval.pass_k=0",
    "log.monitor=false",
    "algorithm=grpo",
    "checkpoint.every_updates=1",
    num_train=16,
    num_test=4,
)
HOLDER = """
import sys
from pathlib import Path
from unipg.runtime.setup import lock_run_dir
lock = lock_run_dir(Path(sys.argv[1]))
print("locked", flush=True)
sys.stdin.read()
"""


def fingerprint(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != LOCK_FILE
    }


def test_a_second_lock_on_a_folder_is_refused_until_the_first_is_released(tmp_path):
    first = lock_run_dir(tmp_path / "run")
    with pytest.raises(ValueError, match=f"run folder {tmp_path / 'run'} is in use by process {os.getpid()};"):
        lock_run_dir(tmp_path / "run")
    first.close()
    lock_run_dir(tmp_path / "run").close()


@pytest.mark.e2e
def test_resuming_a_run_in_use_is_refused_and_touches_nothing(embedded_path, tmp_path):
    run = train_lm(
        load_config(None, SMALL + [f"model.name={embedded_path}", f"log.output_dir={tmp_path}"]),
        log=lambda message: None,
    ).run_dir
    before = fingerprint(run)
    assert "metrics.jsonl" in before and any(name.startswith("checkpoints") for name in before)
    holder = lock_run_dir(run)  # another open file description: flock treats it as another writer
    try:
        result = CliRunner().invoke(app, ["train", "--resume", str(run), "train.updates=2"])
        assert result.exit_code == 2, result.output
        assert f"run folder {run} is in use by process {os.getpid()}" in " ".join(result.output.split())
        assert fingerprint(run) == before
    finally:
        holder.close()
    resumed = CliRunner().invoke(app, ["train", "--resume", str(run), "train.updates=2"])
    assert resumed.exit_code == 0, resumed.output


def test_a_gymnasium_run_into_a_folder_in_use_is_refused(tmp_path):
    holder = lock_run_dir(tmp_path / "named")
    try:
        with pytest.raises(ValueError, match="is in use by process"):
            train_gym(load_config(None, [f"log.output_dir={tmp_path}", "log.run_name=named", "log.progress=false"]))
        assert [path.name for path in (tmp_path / "named").iterdir()] == [LOCK_FILE]
    finally:
        holder.close()


def test_a_killed_writer_leaves_the_folder_usable(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match=f"in use by process {holder.pid};"):
            lock_run_dir(run)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stdin.close()
        holder.stdout.close()
    assert holder.returncode == -signal.SIGKILL
    lock_run_dir(run).close()  # the kernel released the dead process's lock


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_ray_address_with_nothing_listening_is_refused_before_a_run_folder_is_made(embedded_path, tmp_path):
    port = free_port()
    result = CliRunner().invoke(
        app,
        [
            "train",
            "backend=ray",
            f"ray.address=127.0.0.1:{port}",
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            *SMALL,
        ],
    )
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert text.startswith(f"error: cannot connect to Ray at ray.address='127.0.0.1:{port}'") and "ray start" in text
    assert list(tmp_path.iterdir()) == []


def test_ray_addresses_are_checked_in_every_form(monkeypatch):
    port = free_port()
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}", f"[::1]:{port}"):
        with pytest.raises(ValueError, match="cannot connect to Ray"):
            check_ray_address(address)
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    with pytest.raises(ValueError, match="RAY_ADDRESS="):
        check_ray_address(None)
    monkeypatch.delenv("RAY_ADDRESS")
    for address in (None, "local"):
        check_ray_address(address)  # left to Ray: a local instance
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_ray_address(f"127.0.0.1:{server.getsockname()[1]}")


@pytest.fixture
def no_ray_cluster_here(monkeypatch):
    """Ray's lookup of ``auto`` finds no cluster on this machine, whatever other Ray instances run beside the
    tests; yields a function that makes it find one at a given address."""
    services = pytest.importorskip("ray._private.services")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    found = []
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: set(found))
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: found[0] if found else None)
    return found.append


def test_ray_address_auto_without_a_cluster_is_refused_before_a_run_folder_is_made(
    embedded_path, tmp_path, no_ray_cluster_here
):
    with pytest.raises(ValueError, match=r"ray.address=auto .* none is running here.*ray start"):
        check_ray_address("auto")
    result = CliRunner().invoke(
        app,
        [
            "train",
            "backend=ray",
            "ray.address=auto",
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            *SMALL,
        ],
    )
    assert result.exit_code == 2 and "none is running here" in result.output, result.output
    assert list(tmp_path.iterdir()) == []

    no_ray_cluster_here(f"127.0.0.1:{free_port()}")  # a cluster was here and is gone: its address is checked
    with pytest.raises(ValueError, match="cannot connect to Ray"):
        check_ray_address("auto")


def test_connecting_the_ray_backend_to_an_address_with_nothing_listening_fails_at_once():
    ray = pytest.importorskip("ray")
    from unipg.runtime.backends.ray_setup import connect

    if ray.is_initialized():
        pytest.skip("Ray is already connected in this process")
    port = free_port()
    settings = load_config(None, ["task.name=arithmetic", "backend=ray", f"ray.address=127.0.0.1:{port}"]).ray
    with pytest.raises(ValueError, match=f"cannot connect to Ray at ray.address='127.0.0.1:{port}'"):
        connect(settings)
    assert not ray.is_initialized()
