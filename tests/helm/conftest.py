"""The chart under test, loaded once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def chart():
    from tests.helm.rendering import CHART_DIR, helm

    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded
