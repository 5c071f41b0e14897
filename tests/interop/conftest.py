"""One engine and one frontend shared by the interop tests (they leave both idle)."""

from __future__ import annotations

import pytest

from tests.services import start_engine, start_frontend


@pytest.fixture(scope="package")
def services(demo_model_dir):
    engine = start_engine(demo_model_dir, "--num-kv-blocks", "256")
    frontend = None
    try:
        engine.wait_serving()
        frontend = start_frontend(engine.address)
        yield engine, frontend.wait_serving()
    finally:
        if frontend is not None:
            frontend.terminate()
        engine.terminate()
