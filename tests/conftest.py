"""Shared fixtures: the embedded model is built once per test session into a temporary cache."""

from __future__ import annotations

import os

import pytest

import unipg  # noqa: F401  (first: hides torch companions built for another torch before transformers looks)
from tests.helpers.main_job import MARKER as MAIN_JOB_MARKER
from tests.helpers.main_job import MainJobRun
from unipg.tools import sandbox
from unipg.tools.bubblewrap import kernel_isolation_available


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """Keep built models and warm starts out of the user's real cache folder."""
    previous = os.environ.get("UNIPG_CACHE")
    os.environ["UNIPG_CACHE"] = str(tmp_path_factory.mktemp("unipg-cache"))
    yield
    if previous is None:
        os.environ.pop("UNIPG_CACHE", None)
    else:
        os.environ["UNIPG_CACHE"] = previous


@pytest.fixture(scope="session")
def embedded_path(private_cache) -> str:
    """Folder of the embedded model (built on first use), loadable with from_pretrained."""
    from unipg.policy.embedded import embedded_model_path

    return str(embedded_model_path())


@pytest.fixture(scope="session")
def tiny_policy(embedded_path):
    """Factory: ``tiny_policy(**options)`` seeds torch with 0 and loads a fresh copy of the embedded model with
    ``load_lm_policy(embedded_path, **options)`` (e.g. ``value_head=True``). A module that shares one policy
    between its tests wraps it in a fixture of its own scope."""
    import torch

    from unipg.policy.loading import load_lm_policy

    def load(**options):
        torch.manual_seed(0)
        return load_lm_policy(embedded_path, **options)

    return load


@pytest.fixture(scope="module")
def one_torch_thread():
    """For a module that fine-tunes the embedded model outside a run (which would set this, ``set_threads``): on
    a busy machine its small products run many times slower on several threads than on one."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def _in_process_layers_without_bubblewrap(monkeypatch):
    """Without bubblewrap, tests that build the python tool use the in-process layers alone (the escape tests,
    which need the kernel boundary, skip); with it, the default (kernel)."""
    if not kernel_isolation_available():
        for function in (sandbox.run_python, sandbox.run_python_async):  # keyword-only defaults
            monkeypatch.setitem(function.__kwdefaults__, "isolation", "process")
        # the tool factory's last positional default
        monkeypatch.setattr(sandbox.python_tool, "__defaults__", (*sandbox.python_tool.__defaults__[:-1], "process"))


# The README's main job runs in a background process from the end of collection (tests/helpers/main_job.py); its
# acceptance test, marked ``main_job``, moves to the end of the session and waits for it.
_main_job = None


def pytest_collection_modifyitems(config, items):
    waiting = [item for item in items if item.get_closest_marker(MAIN_JOB_MARKER)]
    items[:] = [item for item in items if not item.get_closest_marker(MAIN_JOB_MARKER)] + waiting


def pytest_collection_finish(session):
    global _main_job
    if not session.config.option.collectonly and any(
        item.get_closest_marker(MAIN_JOB_MARKER) for item in session.items
    ):
        _main_job = MainJobRun.start()


def pytest_sessionfinish(session, exitstatus):
    if _main_job is not None:
        _main_job.stop()


@pytest.fixture(scope="session")
def main_job_run() -> MainJobRun:
    """The background run of the main job, started when collection selected a test marked ``main_job``."""
    if _main_job is None:
        pytest.fail("the main job was not started: a test that uses main_job_run must be marked main_job")
    return _main_job
