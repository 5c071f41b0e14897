"""Fixtures of the native kernel tests: every ISA build this CPU can run, compiled once per
test session into one temporary folder (``native_builds.session_build``), and loaded by
each module that asks (a module may define its own ``kernels`` instead)."""

from __future__ import annotations

import pytest

from engine_svc.model.native import NativeKernels
from tests.engine.native_builds import RUNNABLE, session_build


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kernel-builds")


@pytest.fixture(scope="module", params=RUNNABLE)
def kernels(request, build_dir) -> NativeKernels:
    return NativeKernels(session_build(request.param, build_dir), request.param)
