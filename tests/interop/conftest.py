"""One engine and one frontend shared by the interop tests (they leave both idle)."""

from __future__ import annotations

import pytest

from tests.services import running_pair


@pytest.fixture(scope="package")
def services(demo_model_dir):
    # One message per token: the clients' tests read streams of several messages, which the
    # frontend's adaptive coalescing may merge into one when the engine outruns it.
    with running_pair(demo_model_dir, "--num-kv-blocks", "256", frontend_args=("--stream-interval", "1")) as pair:
        yield pair
