"""The HTTP face's flags (service/http/): its port, connection limits, CORS, the Responses
API's store and LoRA admin, one argument group of the frontend's command line (config.py)."""

from __future__ import annotations

import argparse
from typing import Any

from tandem_common.flags import float_in, int_in, json_strings, port

# RFC 9110 token characters: how a method or a header name is spelt.
TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
# scheme://host[:port], no path: the form of a browser's Origin header (RFC 6454).
ORIGIN = r"[A-Za-z][A-Za-z0-9+.-]*://[^/\s?#]+"


def add_http_flags(p: argparse.ArgumentParser, d: Any) -> None:
    """The HTTP flags, with ``d`` (a default FrontendConfig) giving their defaults."""
    h = p.add_argument_group("HTTP API")
    h.add_argument(
        "--http-port",
        type=port,
        default=None,
        metavar="PORT",
        help="also serve the OpenAI-compatible HTTP API (and Anthropic Messages) on this port (0 picks a free "
        "one); off unless given. Same TLS, API keys, limits and metrics as gRPC (docs/http.md)",
    )
    h.add_argument("--http-host", default=None, help="address the HTTP API listens on (default: the same as --host)")
    h.add_argument(
        "--http-idle-timeout-s",
        type=float_in(0.0, lo_open=True),
        default=d.http_idle_timeout_s,
        metavar="S",
        help="an HTTP connection that sends nothing for this long, before its first request or between "
        "requests (keep-alive), is closed",
    )
    h.add_argument(
        "--http-header-timeout-s",
        type=float_in(0.0, lo_open=True),
        default=d.http_header_timeout_s,
        metavar="S",
        help="a request's line and headers must arrive within this long of their first byte: 408 and the "
        "connection closed otherwise",
    )
    h.add_argument(
        "--http-body-timeout-s",
        type=float_in(0.0, lo_open=True),
        default=d.http_body_timeout_s,
        metavar="S",
        help="a request's whole body must arrive within this long of its headers: 408 and the connection "
        "closed otherwise (at the default and a 16 MiB body, about 2.2 Mbit/s)",
    )
    h.add_argument(
        "--http-max-connections",
        type=int_in(0),
        default=d.http_max_connections,
        metavar="N",
        help="HTTP connections open at once (per --workers process), idle keep-alive ones included; more are "
        "answered 503 and closed (0: no limit). Keep it well above --max-concurrent-calls",
    )
    h.add_argument(
        "--http-max-connections-per-address",
        type=int_in(0),
        default=d.http_max_connections_per_address,
        metavar="N",
        help="HTTP connections one client address may hold open at once; more are answered 503 and closed "
        "(0: no cap). Behind a proxy every caller shares its address: raise it or set 0",
    )
    h.add_argument(
        "--http-max-header-bytes",
        type=int_in(1024, 1 << 24),
        default=d.http_max_header_bytes,
        metavar="BYTES",
        help="largest HTTP request line and headers together; larger heads get 431",
    )
    h.add_argument(
        "--http-max-header-fields",
        type=int_in(1),
        default=d.http_max_header_fields,
        metavar="N",
        help="most header fields in an HTTP request; more get 431",
    )
    h.add_argument(
        "--responses-store-max-bytes",
        type=int_in(0),
        default=d.responses_store_max_bytes,
        metavar="BYTES",
        help="the Responses API's stored responses (GET /v1/responses/{id}, previous_response_id), each with its "
        "conversation, in this frontend process's memory: at most this many bytes of their JSON, the oldest "
        "evicted first (0: none stored)",
    )
    h.add_argument(
        "--responses-store-max-age-s",
        type=float_in(0.0, lo_open=True),
        default=d.responses_store_max_age_s,
        metavar="S",
        help="a stored response is dropped this long after it was answered",
    )
    h.add_argument(
        "--http-lora-admin",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), which load or unload a LoRA "
        "adapter on every engine at once (engines need --enable-lora); needs --api-key or --api-key-file",
    )
    h.add_argument(
        "--allowed-origins",
        type=json_strings('origins ("*" or scheme://host[:port])', ORIGIN),
        default=d.allowed_origins,
        metavar="JSON",
        help="origins whose web pages may call the HTTP API (CORS), as a JSON array such as "
        '\'["https://app.example"]\'; "*": any, the default (as vLLM\'s); []: no cross-origin calls',
    )
    h.add_argument(
        "--allowed-methods",
        type=json_strings('HTTP methods ("*" or names such as "POST")', TOKEN),
        default=d.allowed_methods,
        metavar="JSON",
        help='HTTP methods a cross-origin page may use, as a JSON array; "*": any, the default',
    )
    h.add_argument(
        "--allowed-headers",
        type=json_strings('header names ("*" or names such as "authorization")', TOKEN),
        default=d.allowed_headers,
        metavar="JSON",
        help='request headers a cross-origin page may send, as a JSON array; "*": any, the default',
    )
