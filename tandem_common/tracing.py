"""OpenTelemetry set-up shared by both services.

Tracing is off unless an OTLP endpoint is given, by ``--otlp-endpoint`` or by the
standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``
variables. Off means no tracer at all: callers hold ``None`` and skip every span call,
and the global tracer provider is never set. On, spans go through a BatchSpanProcessor
to an OTLP gRPC exporter; the other standard variables (``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_BSP_*`` ...) apply.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
INSECURE_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_INSECURE", "OTEL_EXPORTER_OTLP_INSECURE")


def tracing_endpoint(flag: str | None) -> str | None:
    """The OTLP endpoint in effect: the flag, else the standard variables, else None (off)."""
    if flag:
        return flag
    return next((os.environ[v] for v in ENDPOINT_VARIABLES if os.environ.get(v)), None)


def setup_tracing(default_service_name: str, endpoint_flag: str | None):
    """A TracerProvider exporting over OTLP gRPC, or None when tracing is off.

    The provider is not made the global one: each service passes its tracer explicitly,
    so nothing else in the process starts recording by accident. Call ``shutdown()`` on
    it when the service stops, to flush the last spans.
    """
    endpoint = tracing_endpoint(endpoint_flag)
    if endpoint is None:
        return None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: default_service_name}))
    if endpoint_flag:
        # A bare HOST:PORT means plaintext, as most in-cluster collectors listen;
        # https://... means TLS. The standard *_INSECURE variables still win.
        insecure = None if "://" in endpoint_flag or any(os.environ.get(v) for v in INSECURE_VARIABLES) else True
        exporter = OTLPSpanExporter(endpoint=endpoint_flag, insecure=insecure)
    else:
        exporter = OTLPSpanExporter()  # reads the standard variables itself
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    logger.info("tracing to %s as service %s", endpoint, resource.attributes.get(SERVICE_NAME))
    return provider
