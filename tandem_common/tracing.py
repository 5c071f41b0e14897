"""OpenTelemetry set-up shared by both services.

Which exporters run follows the standard ``OTEL_TRACES_EXPORTER`` (a comma-separated
list):

* unset: ``otlp`` if an OTLP endpoint is given (``--otlp-endpoint``, or the standard
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``), else none;
* ``otlp``: OTLP over gRPC (to the endpoint, or the exporter's default localhost:4317);
* ``console``: every span as JSON on standard output, for a quick look without a collector;
* ``none``: off. Unknown names are reported and skipped; ``--otlp-endpoint`` always adds otlp.

No exporter means no tracer at all: callers hold ``None`` and skip every span call, and
the global tracer provider is never set. Spans go through a BatchSpanProcessor per
exporter; the other standard variables (``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_BSP_*`` ...) apply.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
INSECURE_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_INSECURE", "OTEL_EXPORTER_OTLP_INSECURE")
EXPORTER_VARIABLE = "OTEL_TRACES_EXPORTER"
EXPORTERS = ("otlp", "console")


def tracing_endpoint(flag: str | None) -> str | None:
    """The OTLP endpoint in effect: the flag, else the standard variables, else None (off)."""
    if flag:
        return flag
    return next((os.environ[v] for v in ENDPOINT_VARIABLES if os.environ.get(v)), None)


def trace_exporters(endpoint_flag: str | None) -> list[str]:
    """The exporters in effect, in order (see the module docstring); empty means off."""
    setting = os.environ.get(EXPORTER_VARIABLE, "").strip().lower()
    if not setting:
        return ["otlp"] if tracing_endpoint(endpoint_flag) else []
    names: list[str] = []
    for name in (n.strip() for n in setting.split(",")):
        if name in EXPORTERS and name not in names:
            names.append(name)
        elif name not in ("", "none"):
            logger.warning("%s: unknown trace exporter %r ignored; known: %s", EXPORTER_VARIABLE, name, EXPORTERS)
    if endpoint_flag and "otlp" not in names:
        names.insert(0, "otlp")
    return names


def setup_tracing(default_service_name: str, endpoint_flag: str | None):
    """A TracerProvider with the exporters in effect, or None when tracing is off.

    The provider is not made the global one: each service passes its tracer explicitly,
    so nothing else in the process starts recording by accident. Call ``shutdown()`` on
    it when the service stops, to flush the last spans.
    """
    names = trace_exporters(endpoint_flag)
    if not names:
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: default_service_name}))
    provider = TracerProvider(resource=resource)
    where = []
    for name in names:
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
            where.append("standard output")
        else:
            provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(endpoint_flag)))
            where.append(tracing_endpoint(endpoint_flag) or "the OTLP default endpoint")
    logger.info("tracing to %s as service %s", " and ".join(where), resource.attributes.get(SERVICE_NAME))
    return provider


def _otlp_exporter(endpoint_flag: str | None):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    if endpoint_flag:
        # A bare HOST:PORT means plaintext, as most in-cluster collectors listen;
        # https://... means TLS. The standard *_INSECURE variables still win.
        insecure = None if "://" in endpoint_flag or any(os.environ.get(v) for v in INSECURE_VARIABLES) else True
        return OTLPSpanExporter(endpoint=endpoint_flag, insecure=insecure)
    return OTLPSpanExporter()  # reads the standard variables itself
