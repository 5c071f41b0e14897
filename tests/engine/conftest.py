"""Fixtures of the native kernel tests: every ISA build this CPU can run, compiled once per
test module into a temporary folder (a module may define its own ``kernels`` instead)."""

from __future__ import annotations

import pytest

from engine_svc.model.native import NativeKernels, build
from tests.engine.native_builds import RUNNABLE


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kernel-builds")


@pytest.fixture(scope="module", params=RUNNABLE)
def kernels(request, build_dir) -> NativeKernels:
    return NativeKernels(build(request.param, build_dir), request.param)
