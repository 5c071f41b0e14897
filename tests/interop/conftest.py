"""One engine and one frontend shared by the interop tests (they leave both idle)."""

from __future__ import annotations

import pytest

from tests.services import running_pair


@pytest.fixture(scope="package")
def services(demo_model_dir):
    with running_pair(demo_model_dir, "--num-kv-blocks", "256") as pair:
        yield pair
