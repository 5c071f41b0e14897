"""Prometheus helpers shared by both services."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, gc_collector, platform_collector, process_collector, start_http_server

# Latencies from ~1 ms (a GPU decode step) to a minute (a long CPU request).
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    30.0,
    60.0,
)
# Token counts per request or per step.
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def new_registry() -> CollectorRegistry:
    """A registry with the usual process, platform and GC collectors."""
    registry = CollectorRegistry()
    process_collector.ProcessCollector(registry=registry)
    platform_collector.PlatformCollector(registry=registry)
    gc_collector.GCCollector(registry=registry)
    return registry


def serve_metrics(port: int, registry: CollectorRegistry, host: str = "0.0.0.0") -> None:
    """Serve ``registry`` at http://HOST:PORT/metrics from a daemon thread."""
    start_http_server(port, addr=host, registry=registry)
