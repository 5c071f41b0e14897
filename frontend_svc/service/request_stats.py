"""One Generate call's figures, and what is made of them when it ends.

    GenerateStats(...)        call start: in-flight gauge, server span (when tracing)
      .planned(plan)          prompt tokens, request attributes on the span
      .routed(route, ids)     the engine, why, the predicted cached tokens; trace context for the engine
      .piece(output)          each streamed piece: TTFT, inter-token latency, finish reasons
      .generated(n)           tokens the engine generated for the call (cancelled calls too)
      .end(outcome, message)  status counters, E2E latency, span end, one INFO log line

The log line carries its fields as ``extra`` too, so ``--log-format json`` emits them as
keys: request_id, engine, routing, code, prompt_tokens, completion_tokens, cached_tokens,
predicted_cached_tokens, ttft_s, total_s, finish_reason (and trace_id when tracing). The client's request_id is
escaped and cut (tandem_common.logs.printable), so it can never forge a log line.
"""

from __future__ import annotations

import logging
import time

from frontend_svc.service.caller import Caller, Outcome
from frontend_svc.service.metrics import FrontendMetrics
from frontend_svc.service.tracing import end_rpc_span, start_rpc_span, trace_context_of
from frontend_svc.text.output_processor import ChoiceOutput
from tandem_common.logs import printable

logger = logging.getLogger(__name__)


class GenerateStats:
    def __init__(self, metrics: FrontendMetrics, tracer, caller: Caller, request_id: str) -> None:
        self.start = time.monotonic()
        self.metrics = metrics
        self.span = start_rpc_span(tracer, "Generate", caller.metadata) if tracer is not None else None
        self.request_id = printable(request_id)  # the client's, else the first engine request id
        self.engine = ""
        self.routing = ""  # why that engine (RoutingReason value)
        self.predicted_cached_tokens: int | None = None  # None: nothing was predicted
        self.num_prompt_tokens = 0
        self.num_completion_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reasons: list[str] = []
        self.ttft_s: float | None = None
        self._last_token_at: dict[int, float] = {}  # choice index -> time of its last token
        metrics.in_flight.inc()

    def planned(self, prompt_token_ids: list[int], n: int, params, stop: list[str], operation: str) -> None:
        self.num_prompt_tokens = len(prompt_token_ids)
        self.metrics.prompt_tokens.inc(self.num_prompt_tokens)
        self.metrics.request_prompt_tokens.observe(self.num_prompt_tokens)
        if self.span is not None:
            attributes = {
                "gen_ai.operation.name": operation,
                "gen_ai.request.max_tokens": params.max_tokens,
                "gen_ai.request.temperature": params.temperature,
                "gen_ai.request.top_p": params.top_p,
                "gen_ai.request.top_k": params.top_k,
                "gen_ai.request.presence_penalty": params.presence_penalty,
                "gen_ai.request.frequency_penalty": params.frequency_penalty,
                "gen_ai.request.choice.count": n,
                "gen_ai.usage.input_tokens": self.num_prompt_tokens,
            }
            if params.seed is not None:
                attributes["gen_ai.request.seed"] = params.seed
            if stop:
                attributes["gen_ai.request.stop_sequences"] = stop
            self.span.set_attributes(attributes)

    def routed(
        self, engine: str, engine_request_ids: list[str], reason: str = "", predicted_cached_tokens: int | None = None
    ) -> dict[str, str]:
        """Records the engine and why; returns the trace context to send with the requests ({} when off)."""
        self.engine, self.routing, self.predicted_cached_tokens = engine, reason, predicted_cached_tokens
        self.request_id = self.request_id or engine_request_ids[0]
        if reason:
            self.metrics.routing_decisions.labels(reason).inc()
        if self.span is None:
            return {}
        attributes: dict = {"tandem.engine.address": engine, "tandem.engine.request_ids": engine_request_ids}
        if reason:
            attributes["tandem.routing.reason"] = reason
        if predicted_cached_tokens is not None:
            attributes["tandem.routing.predicted_cached_tokens"] = predicted_cached_tokens
        self.span.set_attributes(attributes)
        return trace_context_of(self.span)

    def piece(self, piece: ChoiceOutput) -> None:
        now = time.monotonic()
        num_tokens = len(piece.token_ids)
        if num_tokens:
            last = self._last_token_at.get(piece.index)
            if last is None:
                if self.ttft_s is None:
                    self.ttft_s = now - self.start
                    self.metrics.ttft.observe(self.ttft_s)
            else:
                # Tokens that arrived together share the gap since the previous piece.
                gap = (now - last) / num_tokens
                for _ in range(num_tokens):
                    self.metrics.itl.observe(gap)
            self._last_token_at[piece.index] = now
        if piece.finished:
            reason = piece.finish_reason.value if piece.finish_reason is not None else "unknown"
            self.finish_reasons.append(reason)
            self.metrics.finished.labels(reason).inc()
            if piece.usage is not None:
                self.num_cached_tokens = max(self.num_cached_tokens, piece.usage.cached_tokens)

    def generated(self, num_tokens: int) -> None:
        """The tokens generated for the call so far, over all choices, as counted in usage
        (for a call retried on another engine, the last engine's)."""
        self.num_completion_tokens = num_tokens

    def end(self, outcome: Outcome, message: str = "") -> None:
        total_s = time.monotonic() - self.start
        m = self.metrics
        m.in_flight.dec()
        m.requests.labels(outcome.name).inc()
        m.generation_tokens.inc(self.num_completion_tokens)
        if outcome is Outcome.OK:
            m.e2e.observe(total_s)
            m.request_generation_tokens.observe(self.num_completion_tokens)
            if self.predicted_cached_tokens is not None:  # the index's accuracy
                predicted, actual = self.predicted_cached_tokens, self.num_cached_tokens
                accuracy = "exact" if predicted == actual else "over" if predicted > actual else "under"
                m.prefix_predictions.labels(accuracy).inc()
                m.predicted_cached_tokens.inc(predicted)
                m.predicted_calls_cached_tokens.inc(actual)
        finish_reason = ",".join(self.finish_reasons)
        fields = {
            "request_id": self.request_id or "-",
            "engine": self.engine or "-",
            "routing": self.routing or None,
            "code": outcome.name,
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_completion_tokens,
            "cached_tokens": self.num_cached_tokens,
            "predicted_cached_tokens": self.predicted_cached_tokens,
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 6),
            "total_s": round(total_s, 6),
            "finish_reason": finish_reason or None,
        }
        if message:
            fields["error"] = message
        if self.span is not None:
            self.span.set_attributes(
                {
                    "gen_ai.usage.output_tokens": self.num_completion_tokens,
                    "gen_ai.usage.cache_read.input_tokens": self.num_cached_tokens,
                    "gen_ai.response.finish_reasons": self.finish_reasons,
                }
            )
            if self.request_id:
                self.span.set_attribute("tandem.request_id", self.request_id)
            fields["trace_id"] = format(self.span.get_span_context().trace_id, "032x")
            end_rpc_span(self.span, outcome, message)
        ttft = "-" if self.ttft_s is None else f"{self.ttft_s:.3f}s"
        logger.info(
            "Generate %s %s: engine=%s routing=%s prompt_tokens=%d completion_tokens=%d cached_tokens=%d "
            "predicted_cached_tokens=%s ttft=%s total=%.3fs finish_reason=%s%s",
            fields["request_id"],
            outcome.name,
            fields["engine"],
            self.routing or "-",
            self.num_prompt_tokens,
            self.num_completion_tokens,
            self.num_cached_tokens,
            "-" if self.predicted_cached_tokens is None else self.predicted_cached_tokens,
            ttft,
            total_s,
            finish_reason or "-",
            f" error={message!r}" if message else "",
            extra=fields,
        )
