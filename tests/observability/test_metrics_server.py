"""The /metrics endpoint both services serve: off their serving threads, a scrape flood
renders the page once per interval (tandem_common/metrics.py), an address that asks too
often gets 429s while others get pages, and connections are accepted at a bounded rate
(tandem_common/scrape_ration.py); on a real socket."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tandem_common.metrics import BURST_RENDERS, MIN_RENDER_INTERVAL_S, REQUEST_TIMEOUT_S, serve_metrics
from tandem_common.scrape_ration import CLIENT_BURST_S, ClientBuckets, TokenBucket


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
    server = serve_metrics(0, registry, host="127.0.0.1", client_rate=0)  # no ration per address here
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


def _scrape(port: int, source: str = "127.0.0.1") -> tuple[int, str]:
    """(status, Retry-After) of one GET /metrics from ``source``, a loopback address."""
    with socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0)) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = b""
        while data := s.recv(65536):
            answer += data
    head = answer.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    retry_after = next((line.partition(":")[2].strip() for line in head if line.lower().startswith("retry-after")), "")
    return int(head[0].split()[1]), retry_after


def test_an_address_that_asks_too_often_gets_429_and_another_still_gets_pages():
    rate = 5.0
    server = serve_metrics(0, CollectorRegistry(), host="127.0.0.1", client_rate=rate)
    try:
        answers = [_scrape(server.port) for _ in range(int(rate * CLIENT_BURST_S) + 5)]
        statuses = [status for status, _ in answers]
        assert statuses.count(200) <= rate * CLIENT_BURST_S + 1, statuses  # the burst, and what refilled meanwhile
        assert statuses[-1] == 429 and answers[-1][1].isdigit() and int(answers[-1][1]) >= 1, answers[-1]
        assert _scrape(server.port, source="127.0.0.2")[0] == 200  # a bucket of its own
        assert server.num_refused == statuses.count(429)
    finally:
        server.close()


def test_connections_are_accepted_at_most_max_rate_a_second_however_many_come():
    rate = 20.0
    server = serve_metrics(0, CollectorRegistry(), host="127.0.0.1", client_rate=0, max_rate=rate)
    statuses: dict[int, int] = {}
    until = time.monotonic() + 2.0

    def flood() -> None:
        while time.monotonic() < until:
            status = _scrape(server.port)[0]
            statuses[status] = statuses.get(status, 0) + 1

    try:
        t0 = time.monotonic()
        threads = [threading.Thread(target=flood) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        elapsed = time.monotonic() - t0
        # A second's worth at once, then the rate; the rest waited in the listen queue.
        assert list(statuses) == [200] and statuses[200] <= rate * (elapsed + 1) + 1, (statuses, elapsed)
    finally:
        server.close()


def test_token_buckets_refill_at_their_rate_and_forget_the_least_recent_address():
    bucket = TokenBucket(rate=2.0, burst=3.0, now=0.0)
    assert [bucket.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.wait_s(0.0) == 0.5 and bucket.wait_s(0.0, tokens=3) == 1.5
    assert bucket.take(0.5) and not bucket.take(0.5)
    clients = ClientBuckets(rate=1.0, max_clients=2)  # a burst of CLIENT_BURST_S = 2 pages
    assert [clients.admit("a", 0.0) for _ in range(3)] == [0.0, 0.0, 1.0]
    assert clients.admit("b", 0.0) == 0.0 and clients.admit("c", 0.0) == 0.0  # "a" is forgotten ...
    assert clients.admit("a", 0.0) == 0.0  # ... and comes back with a full bucket
    assert ClientBuckets(rate=0.0).admit("a", 0.0) == 0.0  # 0: no limit per address
