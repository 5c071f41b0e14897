"""Command-line helpers both services share: checked number types, the help formatter, and
the flag groups both have (observability, the server's TLS).

A flag with an impossible value must stop the service at start with a message that names
the flag and the range it accepts, never start a service that then hangs or refuses every
request. Use these as ``type=`` in argparse; argparse turns the error into
``tandem-engine: error: argument --max-num-seqs: must be an integer >= 1, got 0``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable

from tandem_common.scrape_ration import DEFAULT_CLIENT_RATE, DEFAULT_MAX_RATE

MAX_PORT = 65535
# gRPC keeps message sizes in a signed 32-bit int.
MAX_MESSAGE_BYTES = 2**31 - 1
# Below this a single output with 20 logprobs per token no longer fits a stream message (an
# engine stream message is a quarter of the limit); small limits are for tests of the bounds.
MIN_MESSAGE_BYTES = 2048
LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]  # --log-level, any case


def _describe(lo: float | None, hi: float | None, kind: str, lo_open: bool = False) -> str:
    def num(v: float) -> str:
        return str(v) if isinstance(v, int) else f"{v:g}"

    if lo is not None and hi is not None:
        return f"{kind} in {'(' if lo_open else '['}{num(lo)}, {num(hi)}]"
    if lo is not None:
        return f"{kind} {'>' if lo_open else '>='} {num(lo)}"
    assert hi is not None
    return f"{kind} <= {num(hi)}"


def int_in(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi] (either bound may be None)."""
    what = _describe(lo, hi, "an integer")

    def parse(text: str) -> int:
        try:
            value = int(text, 0)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    parse.__name__ = "int"  # what argparse calls the type in its own messages
    return parse


def float_in(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in [lo, hi] ((lo, hi] with ``lo_open``)."""
    what = _describe(lo, hi, "a number", lo_open)

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        too_low = lo is not None and (value <= lo if lo_open else value < lo)
        if not math.isfinite(value) or too_low or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    parse.__name__ = "float"
    return parse


port = int_in(0, MAX_PORT)  # 0 picks a free port
metrics_port = int_in(0, MAX_PORT)  # 0 turns metrics off
message_bytes = int_in(MIN_MESSAGE_BYTES, MAX_MESSAGE_BYTES)
seconds = float_in(0.0)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" only where it says something: not for defaults of None (the
    help says what happens then) and not where the help already names its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if action.default is None or action.default is argparse.SUPPRESS or "default" in help_text:
            return help_text
        return super()._get_help_string(action) or help_text


# -- flag groups both services have -------------------------------------------------------


def json_strings(what: str, pattern: str, wildcard: str | None = "*") -> Callable[[str], list[str]]:
    """An argparse type: a JSON array of strings (vLLM's form for its list flags), each
    ``wildcard`` or matching ``pattern``; ``what`` names them in the error."""
    check = re.compile(pattern)

    def parse(text: str) -> list[str]:
        try:
            values = json.loads(text)
        except ValueError:
            values = None
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise argparse.ArgumentTypeError(f"must be a JSON array of {what}, got {text!r}")
        bad = [v for v in values if v != wildcard and check.fullmatch(v) is None]
        if bad:
            raise argparse.ArgumentTypeError(f"must be a JSON array of {what}, got {bad[0]!r}")
        return values

    parse.__name__ = "JSON array"
    return parse


def add_observability_flags(p: argparse.ArgumentParser, *, log_level: str = "INFO", log_format: str = "text") -> None:
    """The "observability" group: metrics endpoint, logs and tracing, alike in both services
    (their configs have the fields metrics_port, metrics_host, metrics_client_rate,
    metrics_max_rate, log_level, log_format and otlp_endpoint)."""
    o = p.add_argument_group("observability")
    o.add_argument("--metrics-port", type=metrics_port, default=0, help="Prometheus port (0 = off)")
    o.add_argument(
        "--metrics-host", default=None, help="address the metrics endpoint listens on (default: the same as --host)"
    )
    o.add_argument(
        "--metrics-client-rate",
        type=float_in(0.0),
        default=DEFAULT_CLIENT_RATE,
        metavar="PER_S",
        help="metrics pages a second one client address may ask for (a burst of 2 s of them); more are answered "
        "429 with Retry-After (0: no limit per address)",
    )
    o.add_argument(
        "--metrics-max-rate",
        type=float_in(0.0, lo_open=True),
        default=DEFAULT_MAX_RATE,
        metavar="PER_S",
        help="connections a second the metrics endpoint accepts from all clients together, which bounds what "
        "scrapes cost the service; more wait in the kernel's listen queue",
    )
    o.add_argument("--log-level", default=log_level, type=str.upper, choices=LOG_LEVELS, help="log threshold")
    o.add_argument(
        "--log-format", default=log_format, choices=["text", "json"], help="text lines, or one JSON object per line"
    )
    o.add_argument(
        "--otlp-endpoint",
        default=None,
        help="OTLP gRPC endpoint for traces, e.g. http://otel-collector:4317 (HOST:PORT alone means "
        "plaintext); default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT, "
        "tracing is off when none is set",
    )


def add_server_tls_flags(group: argparse._ArgumentGroup, *, client_ca: bool) -> None:
    """--tls-cert and --tls-key of the service's own port; with ``client_ca``, --tls-ca too
    (mutual TLS: clients must show a certificate that chains to it)."""
    group.add_argument("--tls-cert", default=None, help="server certificate (PEM); enables TLS")
    group.add_argument("--tls-key", default=None, help="server private key (PEM)")
    if client_ca:
        group.add_argument(
            "--tls-ca", default=None, help="CA (PEM) that client certificates must chain to (mutual TLS)"
        )
