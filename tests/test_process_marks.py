"""The ``services`` marker: found from what a test's code and fixtures name, nothing started."""

from __future__ import annotations

import pytest

from engine_svc.sched.scheduler import Scheduler
from tests.process_marks import ProcessWalk
from tests.services import ServiceProcess, running_pair, start_engine, start_frontend


def _in_process() -> Scheduler | None:
    return None


def _through_a_local_import() -> None:
    from tests.services import start_frontend as start

    start("127.0.0.1:1")


def _through_a_starter() -> None:
    from engine_svc.demo_checkpoint import fetch_demo_gguf

    fetch_demo_gguf()


def _through_a_lambda() -> None:
    list(map(lambda address: start_frontend(address), []))


@pytest.mark.parametrize(
    "helper",
    [
        ServiceProcess,
        start_engine,
        start_frontend,
        running_pair,
        _through_a_local_import,
        _through_a_lambda,
        _through_a_starter,
    ],
)
def test_helpers_that_start_processes_are_found(helper):
    assert ProcessWalk().starts_processes(helper)


@pytest.mark.parametrize("code", [_in_process, Scheduler, pytest.fixture, len])
def test_in_process_code_is_not(code):
    assert not ProcessWalk().starts_processes(code)


def test_an_in_process_test_is_left_unmarked(request):
    assert request.node.get_closest_marker("services") is None


def test_a_test_that_names_a_process_helper_is_marked(request):
    starter = start_engine  # named, never called: naming it is what marks the test
    assert callable(starter) and request.node.get_closest_marker("services") is not None


def test_a_fixture_that_starts_processes_marks_its_tests(request, engine_starter):
    assert engine_starter is start_engine and request.node.get_closest_marker("services") is not None


@pytest.fixture
def engine_starter():
    """Hands out the helper without calling it; the test above names no helper itself."""
    return start_engine
