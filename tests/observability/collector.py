"""A stand-in for an OpenTelemetry collector: an OTLP/gRPC TraceService on 127.0.0.1
that keeps every exported span in memory, so tests check the real export path."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(v: AnyValue):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class CollectedSpan:
    service: str
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root span
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict
    events: list[tuple[str, int, dict]] = field(default_factory=list)  # (name, time_ns, attributes)

    @property
    def event_names(self) -> list[str]:
        return [e[0] for e in self.events]


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, collector: Collector) -> None:
        self.collector = collector

    def Export(self, request, context):
        spans = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        CollectedSpan(
                            service=resource.get("service.name", ""),
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            events=[
                                (e.name, e.time_unix_nano, {a.key: _value(a.value) for a in e.attributes})
                                for e in s.events
                            ],
                        )
                    )
        with self.collector.lock:
            self.collector.spans.extend(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class Collector:
    def __init__(self) -> None:
        self.spans: list[CollectedSpan] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    def __enter__(self) -> Collector:
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop(grace=None)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def trace(self, trace_id: str) -> list[CollectedSpan]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout: float = 15.0) -> dict[str, CollectedSpan]:
        """The spans of ``trace_id`` by name, once every one of ``names`` has arrived."""
        deadline = time.monotonic() + timeout
        while True:
            spans = {s.name: s for s in self.trace(trace_id)}
            if names <= spans.keys():
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"spans {sorted(names - spans.keys())} of trace {trace_id} never arrived; got {sorted(spans)}"
                )
            time.sleep(0.05)
