"""Prometheus metrics of the engine, served on ``--metrics-port``.

Gauges follow the engine's snapshot after every turn of its loop (``EngineLoop.on_stats``:
steps, aborts and going idle alike), step figures after every step; request
figures come from lifecycle events (``RequestListener``), so requests refused at once
(invalid, queue full, draining) count too. docs/observability.md lists every metric.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine_svc.outputs import EngineOutput, EngineStats, SpecDecodeStats, StructuredStats
from engine_svc.service.engine_loop import EngineLoop
from engine_svc.service.lifecycle import RequestListener, RequestTimeline
from tandem_common.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS, new_registry, serve_metrics
from tandem_common.scrape_ration import DEFAULT_CLIENT_RATE, DEFAULT_MAX_RATE


class EngineMetrics(RequestListener):
    def __init__(
        self,
        port: int,
        registry: CollectorRegistry | None = None,
        host: str = "127.0.0.1",
        *,
        client_rate: float = DEFAULT_CLIENT_RATE,
        max_rate: float = DEFAULT_MAX_RATE,
    ) -> None:
        self.registry = registry or new_registry()
        r = self.registry
        self.running = Gauge("tandem_engine_requests_running", "Requests being computed", registry=r)
        self.waiting = Gauge("tandem_engine_requests_waiting", "Requests queued", registry=r)
        self.paused = Gauge(
            "tandem_engine_requests_paused",
            "Requests held back because their stream's or their caller's reader lags",
            registry=r,
        )
        self.kv_usage = Gauge("tandem_engine_kv_cache_usage_ratio", "Fraction of KV blocks in use", registry=r)
        self.hit_rate = Gauge(
            "tandem_engine_prefix_cache_hit_ratio",
            "Fraction of queried prompt tokens served from the prefix cache",
            registry=r,
        )
        self.step_time = Histogram(
            "tandem_engine_step_duration_seconds", "Duration of one engine step", buckets=LATENCY_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            "tandem_engine_step_batch_tokens", "Tokens computed per step", buckets=TOKEN_BUCKETS, registry=r
        )
        self.preemptions = Counter("tandem_engine_preemptions_total", "Requests preempted for recompute", registry=r)
        self.generated = Counter("tandem_engine_generation_tokens_total", "Tokens generated", registry=r)
        self.prompt = Counter(
            "tandem_engine_prompt_tokens_total", "Prompt tokens of requests admitted for the first time", registry=r
        )
        self.prompt_cached = Counter(
            "tandem_engine_prompt_tokens_cached_total",
            "Prompt tokens served from the prefix cache at first admission",
            registry=r,
        )
        self.finished = Counter(
            "tandem_engine_requests_finished_total", "Finished requests by reason", ["finish_reason"], registry=r
        )
        self.queue_time = Histogram(
            "tandem_engine_request_queue_time_seconds",
            "Time from arrival in the engine to first admission",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "tandem_engine_time_to_first_token_seconds",
            "Time from arrival in the engine to the first output token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tandem_engine_e2e_request_latency_seconds",
            "Time from arrival in the engine to the end of the request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_prompt = Histogram(
            "tandem_engine_request_prompt_tokens",
            "Prompt tokens per finished request",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.request_generation = Histogram(
            "tandem_engine_request_generation_tokens",
            "Output tokens per finished request",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.structured_requests = Counter(
            "tandem_engine_structured_requests_total",
            "Requests with an output constraint, by kind (json_schema, json_object, regex, choice, grammar)",
            ["kind"],
            registry=r,
        )
        self.structured_cache_hits = Counter(
            "tandem_engine_structured_cache_hits_total",
            "Constrained requests whose grammar was already compiled (no compile wait)",
            registry=r,
        )
        self.structured_refused = Counter(
            "tandem_engine_structured_refused_total",
            "Constrained requests refused: constraint does not compile (invalid) or compiled too slowly (timeout)",
            ["reason"],
            registry=r,
        )
        self.structured_compile_time = Histogram(
            "tandem_engine_structured_compile_duration_seconds",
            "Time to compile one output constraint against the tokenizer (cache misses only)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.spec_drafts = Counter(
            "tandem_engine_spec_decode_num_drafts_total", "Verifications of speculative draft tokens", registry=r
        )
        self.spec_draft_tokens = Counter(
            "tandem_engine_spec_decode_num_draft_tokens_total", "Speculative draft tokens verified", registry=r
        )
        self.spec_accepted_tokens = Counter(
            "tandem_engine_spec_decode_num_accepted_tokens_total", "Speculative draft tokens accepted", registry=r
        )
        self.spec_accepted_per_position = Counter(
            "tandem_engine_spec_decode_num_accepted_tokens_per_pos_total",
            "Speculative draft tokens accepted, by position in the draft (0 first)",
            ["position"],
            registry=r,
        )
        self.spec_mean_accepted_length = Gauge(
            "tandem_engine_spec_decode_mean_accepted_length",
            "Tokens per verification since start: accepted drafts plus the one sampled after them",
            registry=r,
        )
        self.lora_requests = Counter(
            "tandem_engine_lora_requests_finished_total", "Finished requests by LoRA adapter", ["adapter"], registry=r
        )
        self.lora_prompt_tokens = Counter(
            "tandem_engine_lora_prompt_tokens_total", "Prompt tokens of finished requests by LoRA adapter", ["adapter"],
            registry=r,
        )  # fmt: skip
        self.lora_generation_tokens = Counter(
            "tandem_engine_lora_generation_tokens_total", "Tokens generated by LoRA adapter", ["adapter"], registry=r
        )
        self.lora_adapters = Gauge("tandem_engine_lora_adapters_loaded", "LoRA adapters requests may name", registry=r)
        self.lora_events = Counter(
            "tandem_engine_lora_adapter_events_total",
            "LoRA adapters loaded, unloaded and read back after an eviction",
            ["event"],
            registry=r,
        )
        self.lora_event_time = Histogram(
            "tandem_engine_lora_adapter_event_duration_seconds",
            "Time to load, unload or read back one LoRA adapter",
            ["event"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._spec_seen = SpecDecodeStats()
        self._preemptions_seen = 0
        self._structured_seen = StructuredStats()
        self.port = port
        if port:
            serve_metrics(port, r, host=host, client_rate=client_rate, max_rate=max_rate)

    def attach(self, engine: EngineLoop) -> None:
        """Start observing ``engine``; call before ``engine.start()``."""
        engine.on_stats = self.observe
        engine.add_listener(self)

    def observe(self, stats: EngineStats, outputs: list[EngineOutput]) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.paused.set(stats.num_paused)
        self.kv_usage.set(stats.kv_cache_usage)
        self.hit_rate.set(stats.prefix_cache_hit_rate)
        if stats.step is not None:
            self.step_time.observe(stats.step.duration_s)
            self.batch_tokens.observe(stats.step.num_batched_tokens)
        new = stats.num_preemptions - self._preemptions_seen
        if new > 0:
            self.preemptions.inc(new)
            self._preemptions_seen = stats.num_preemptions
        num_generated = sum(len(out.new_token_ids) for out in outputs)
        if num_generated:
            self.generated.inc(num_generated)
        self._observe_structured(stats.structured)
        self.lora_adapters.set(len(stats.lora_adapters))
        for event, seconds in stats.lora_events:
            self.lora_events.labels(event).inc()
            self.lora_event_time.labels(event).observe(seconds)
        if stats.spec_decode is not None:
            self._observe_spec_decode(stats.spec_decode)

    def _observe_spec_decode(self, s: SpecDecodeStats) -> None:
        """Counters from the snapshot's running totals."""
        seen = self._spec_seen
        if s.num_drafts == seen.num_drafts:
            return
        self.spec_drafts.inc(s.num_drafts - seen.num_drafts)
        self.spec_draft_tokens.inc(s.num_draft_tokens - seen.num_draft_tokens)
        self.spec_accepted_tokens.inc(s.num_accepted_tokens - seen.num_accepted_tokens)
        before = seen.accepted_per_position
        for i, n in enumerate(s.accepted_per_position):
            if n > (before[i] if i < len(before) else 0):
                self.spec_accepted_per_position.labels(str(i)).inc(n - (before[i] if i < len(before) else 0))
        self.spec_mean_accepted_length.set(s.mean_accepted_length)
        self._spec_seen = s

    def _observe_structured(self, s: StructuredStats) -> None:
        """Counters from the snapshot's running totals; durations are per snapshot."""
        seen = self._structured_seen
        if s.requests_by_kind != seen.requests_by_kind:
            before = dict(seen.requests_by_kind)
            for kind, n in s.requests_by_kind:
                if n > before.get(kind, 0):
                    self.structured_requests.labels(kind).inc(n - before.get(kind, 0))
        if s.num_cache_hits > seen.num_cache_hits:
            self.structured_cache_hits.inc(s.num_cache_hits - seen.num_cache_hits)
        if s.num_failed > seen.num_failed:
            self.structured_refused.labels("invalid").inc(s.num_failed - seen.num_failed)
        if s.num_timeouts > seen.num_timeouts:
            self.structured_refused.labels("timeout").inc(s.num_timeouts - seen.num_timeouts)
        for duration in s.compile_durations_s:
            self.structured_compile_time.observe(duration)
        self._structured_seen = s

    # -- lifecycle events --------------------------------------------------------------

    def on_scheduled(self, timeline: RequestTimeline) -> None:
        request = timeline.request
        self.queue_time.observe(timeline.queue_time_s)
        self.prompt.inc(request.num_prompt_tokens)
        if request.num_cached_tokens > 0:
            self.prompt_cached.inc(request.num_cached_tokens)

    def on_first_token(self, timeline: RequestTimeline) -> None:
        self.ttft.observe(timeline.time_to_first_token_s)

    def on_finished(self, timeline: RequestTimeline, output: EngineOutput) -> None:
        reason = output.finish_reason.value if output.finish_reason is not None else "unknown"
        self.finished.labels(reason).inc()
        self.e2e.observe(timeline.e2e_s)
        self.request_prompt.observe(timeline.request.num_prompt_tokens)
        self.request_generation.observe(timeline.request.num_output_tokens)
        # Only requests an adapter served: one refused for naming no loaded adapter would
        # otherwise mint a label per name a client makes up.
        adapter = timeline.request.lora_name
        if adapter is not None and timeline.request.lora_slot is not None:
            self.lora_requests.labels(adapter).inc()
            self.lora_prompt_tokens.labels(adapter).inc(timeline.request.num_prompt_tokens)
            self.lora_generation_tokens.labels(adapter).inc(timeline.request.num_output_tokens)
