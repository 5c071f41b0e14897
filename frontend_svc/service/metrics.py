"""Prometheus metrics of the frontend, served on ``--metrics-port``.

docs/observability.md lists every metric. Latencies are measured from the moment a
Generate call reaches the servicer, on the frontend's clock.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
        self.in_flight = Gauge("tandem_frontend_requests_in_flight", "Generate calls in progress", registry=r)
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
        self.engines_connected = Gauge("tandem_frontend_engines_connected", "Engines with a live stream", registry=r)
        self.engines_refused = Gauge(
            "tandem_frontend_engines_refused",
            "Engines refused because they serve another model than the first engine accepted",
            registry=r,
        )

    def serve(self, port: int, host: str) -> None:
        serve_metrics(port, self.registry, host=host)
