"""Fixtures for the fault tests: real services as subprocesses on 127.0.0.1, always stopped.

``shared`` is one engine plus one frontend used by the tests that leave them idle and
healthy (each such test checks that it did); tests that kill or restart a service start
their own through ``procs``.
"""

from __future__ import annotations

from contextlib import ExitStack

import pytest

from tests.services import ServiceProcess, running_pair


@pytest.fixture(scope="package")
def shared(demo_model_dir):
    with running_pair(demo_model_dir, "--num-kv-blocks", "512") as pair:
        yield pair


@pytest.fixture
def procs():
    """Registers started services; all are stopped (SIGTERM, then SIGKILL) when the test ends."""
    with ExitStack() as stack:

        def run(proc: ServiceProcess) -> ServiceProcess:
            stack.callback(proc.terminate, 20.0)
            return proc

        yield run
