"""The /metrics endpoint both services serve: off their serving threads, and a scrape flood
renders the page once per interval (tandem_common/metrics.py), on a real socket."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tandem_common.metrics import BURST_RENDERS, MIN_RENDER_INTERVAL_S, REQUEST_TIMEOUT_S, serve_metrics


class _Renders(Collector):
    """Counts how often the page is rendered, and shows the count."""

    def __init__(self) -> None:
        self.num = 0

    def collect(self):
        self.num += 1
        yield GaugeMetricFamily("test_renders", "times collected", value=self.num)


@pytest.fixture
def endpoint():
    registry = CollectorRegistry()
    renders = _Renders()
    registry.register(renders)
    requests = Counter("test_requests", "a counter the test moves", registry=registry)
    server = serve_metrics(0, registry, host="127.0.0.1")
    try:
        yield f"http://127.0.0.1:{server.port}", renders, requests
    finally:
        server.close()


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as page:
        return page.read().decode()


def test_a_scrape_flood_renders_once_per_interval(endpoint):
    url, renders, _ = endpoint
    t0 = time.monotonic()
    pages = [_get(f"{url}/metrics") for _ in range(100)]
    elapsed = time.monotonic() - t0
    assert all("test_renders" in p for p in pages)
    assert renders.num <= elapsed / MIN_RENDER_INTERVAL_S + BURST_RENDERS + 1, (renders.num, elapsed)


def test_an_occasional_scrape_sees_fresh_figures_and_a_flood_gets_fresh_ones_each_interval(endpoint):
    url, _, requests = endpoint
    assert "test_requests_total 0.0" in _get(f"{url}/metrics")
    requests.inc()
    assert "test_requests_total 1.0" in _get(f"{url}/metrics")  # within the burst: rendered now
    for _ in range(3 * BURST_RENDERS):  # a flood empties the bucket ...
        _get(f"{url}/metrics")
    requests.inc()
    time.sleep(MIN_RENDER_INTERVAL_S * 1.5)  # ... which refills one render per interval
    assert "test_requests_total 2.0" in _get(f"{url}/metrics")


def test_a_silent_connection_does_not_hold_the_endpoint_and_other_paths_are_404(endpoint):
    url, _, _ = endpoint
    port = int(url.rpartition(":")[2])
    with socket.create_connection(("127.0.0.1", port)):  # sends nothing
        t0 = time.monotonic()
        assert "test_renders" in _get(f"{url}/metrics")
        assert time.monotonic() - t0 < REQUEST_TIMEOUT_S / 2
    with pytest.raises(urllib.error.HTTPError) as e:
        _get(f"{url}/other")
    assert e.value.code == 404
