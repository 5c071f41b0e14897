"""Prometheus metrics of the frontend, served on ``--metrics-port``.

docs/observability.md lists every metric. Latencies are measured from the moment a
Generate call reaches the servicer, on the frontend's clock.

With ``--workers N`` each worker writes its metrics to files (prometheus-client's
multiprocess mode) and the parent serves them summed (``serve_multiprocess``): counters
and histograms add up over the workers, and each gauge says how it combines
(``multiprocess_mode``). Scrape-time collectors (the per-engine gauges, the process
figures) exist only in one process and are left out with several workers.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tandem_common.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS, new_registry, serve_metrics


class FrontendMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or new_registry()
        r = self.registry
        self.requests = Counter(
            "tandem_frontend_requests", "Generate calls by final gRPC status code", ["code"], registry=r
        )
        self.finished = Counter(
            "tandem_frontend_requests_finished",
            "Generate outputs that finished, by finish reason (each of n choices counts)",
            ["finish_reason"],
            registry=r,
        )
        self.in_flight = Gauge(
            "tandem_frontend_requests_in_flight", "Generate calls in progress", registry=r, multiprocess_mode="livesum"
        )
        self.ttft = Histogram(
            "tandem_frontend_time_to_first_token_seconds",
            "Call start to the first response carrying an output token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "tandem_frontend_inter_token_latency_seconds",
            "Time between output tokens of one choice, as streamed (one observation per token)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tandem_frontend_e2e_request_latency_seconds",
            "Call start to the last response, for calls that end OK",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tandem_frontend_prompt_tokens", "Prompt tokens of Generate calls sent to an engine", registry=r
        )
        self.generation_tokens = Counter(
            "tandem_frontend_generation_tokens", "Output tokens, over all choices", registry=r
        )
        self.request_prompt_tokens = Histogram(
            "tandem_frontend_request_prompt_tokens",
            "Prompt tokens per Generate call",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            "tandem_frontend_request_generation_tokens",
            "Output tokens per Generate call that ends OK (all choices)",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        # With several workers: the fewest engines any worker has a stream to (0 when one has none).
        self.engines_connected = Gauge(
            "tandem_frontend_engines_connected", "Engines with a live stream", registry=r, multiprocess_mode="livemin"
        )
        self.engines_refused = Gauge(
            "tandem_frontend_engines_refused",
            "Engines refused because they serve another model than the first engine accepted",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.routing_decisions = Counter(
            "tandem_frontend_routing_decisions",
            "Engine choices by reason: least_load, single_engine, prefix_hit, load_fallback, no_hit",
            ["reason"],
            registry=r,
        )
        self.prefix_predictions = Counter(
            "tandem_frontend_prefix_predictions",
            "Calls whose cached prompt tokens were predicted at routing, by how the engine's usage "
            "compared: exact, over (predicted more), under (predicted fewer)",
            ["outcome"],
            registry=r,
        )
        self.predicted_cached_tokens = Counter(
            "tandem_frontend_predicted_cached_tokens",
            "Prompt tokens predicted to be served from the chosen engine's prefix cache",
            registry=r,
        )
        self.predicted_calls_cached_tokens = Counter(
            "tandem_frontend_predicted_calls_cached_tokens",
            "Prompt tokens the engines served from their prefix caches, for calls with a prediction",
            registry=r,
        )

    def watch_engines(self, loads: Callable[[], dict[str, tuple[int, int]]]) -> None:
        """Per-engine gauges read at scrape time: ``loads()`` -> {address: (load tokens, index blocks)}."""
        self.registry.register(_EngineCollector(loads))

    def watch_prefix_index(self, num_dropped: Callable[[], int]) -> None:
        """The prefix index's dropped hashes, read at scrape time."""
        self.registry.register(_DroppedBlocksCollector(num_dropped))

    def serve(self, port: int, host: str, *, client_rate: float, max_rate: float) -> None:
        """Serve the page, rationed per client address and in all (tandem_common/scrape_ration.py)."""
        serve_metrics(port, self.registry, host=host, client_rate=client_rate, max_rate=max_rate)


def serve_multiprocess(port: int, host: str, path: str, *, client_rate: float, max_rate: float) -> None:
    """Serves the metrics the processes writing to ``path`` record, combined (--workers)."""
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=path)
    serve_metrics(port, registry, host=host, client_rate=client_rate, max_rate=max_rate)


def mark_worker_dead(pid: int, path: str) -> None:
    """Drops a stopped worker's live gauges (livesum, livemin, livemax)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, path)


class _EngineCollector(Collector):
    def __init__(self, loads: Callable[[], dict[str, tuple[int, int]]]) -> None:
        self._loads = loads

    def collect(self):
        load = GaugeMetricFamily(
            "tandem_frontend_engine_load_tokens",
            "Queued and running tokens of each connected engine, as routing sees them",
            labels=["engine"],
        )
        blocks = GaugeMetricFamily(
            "tandem_frontend_prefix_index_blocks",
            "Prefix-cache blocks each engine holds, as the frontend's index knows them (prefix routing)",
            labels=["engine"],
        )
        for engine, (tokens, num_blocks) in sorted(self._loads().items()):
            load.add_metric([engine], tokens)
            blocks.add_metric([engine], num_blocks)
        return [load, blocks]


class _DroppedBlocksCollector(Collector):
    def __init__(self, num_dropped: Callable[[], int]) -> None:
        self._num_dropped = num_dropped

    def collect(self):
        family = CounterMetricFamily(
            "tandem_frontend_prefix_index_dropped_blocks",
            "Prefix-cache block hashes an engine published past the blocks its pool holds, dropped by the index",
        )
        family.add_metric([], self._num_dropped())
        return [family]
