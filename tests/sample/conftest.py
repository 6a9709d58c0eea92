"""Fixtures of the sample tests."""

import pytest

from unipg.sample.tools import sandbox
from unipg.sample.tools.bubblewrap import kernel_isolation_available


@pytest.fixture(autouse=True)
def _in_process_layers_without_bubblewrap(monkeypatch):
    """Without bubblewrap, tests that build the python tool use the in-process layers alone (the escape tests,
    which need the kernel boundary, skip); with it, the default (kernel)."""
    if not kernel_isolation_available():
        for function in (sandbox.run_python, sandbox.run_python_async):  # keyword-only defaults
            monkeypatch.setitem(function.__kwdefaults__, "isolation", "process")
        # the tool factory's last positional default
        monkeypatch.setattr(sandbox.python_tool, "__defaults__", (*sandbox.python_tool.__defaults__[:-1], "process"))
