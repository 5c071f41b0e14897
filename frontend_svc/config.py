"""The frontend's configuration: one dataclass, built once from the command line."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from frontend_svc.engine.routing import DEFAULT_LOAD_THRESHOLD_TOKENS
from frontend_svc.engine.watchdog import DEFAULT_PROGRESS_FACTOR, DEFAULT_PROGRESS_FLOOR_S
from frontend_svc.http_flags import add_http_flags
from frontend_svc.text.chat_template.renderer import TemplateBudget
from frontend_svc.text.reasoning import REASONING_PARSERS
from frontend_svc.text.tools import FORMATS
from tandem_common.flags import (
    HelpFormatter,
    add_observability_flags,
    add_server_tls_flags,
    float_in,
    int_in,
    message_bytes,
    port,
    seconds,
)
from tandem_common.scrape_ration import DEFAULT_CLIENT_RATE, DEFAULT_MAX_RATE


@dataclass
class FrontendConfig:
    # Each entry is HOST:PORT (one engine) or dns:///NAME:PORT (every address NAME
    # resolves to, re-resolved every dns_refresh_s seconds).
    engines: list[str] = field(default_factory=list)
    dns_refresh_s: float = 10.0
    engine_stall_timeout_s: float = 10.0
    engine_progress_timeout_s: float = 30.0  # 0: off (engine/watchdog.py)
    engine_progress_factor: float = DEFAULT_PROGRESS_FACTOR  # 0: no judging against other engines
    engine_progress_floor_s: float = DEFAULT_PROGRESS_FLOOR_S
    # "least-load" or "prefix"; None: prefix when there can be two or more engines (two
    # --engine flags or a dns:/// name), least-load with one (nothing to choose from, and
    # the engine then records no prefix-cache events for this frontend).
    routing: str | None = None
    routing_load_threshold: int = DEFAULT_LOAD_THRESHOLD_TOKENS
    host: str = "127.0.0.1"
    port: int = 50050
    http_port: int | None = None  # None: no HTTP face; 0 picks a free port (service/http/)
    http_host: str | None = None  # None: the service's --host
    # HTTP connections (service/http/connection.py): deadlines and caps, as nginx sets them.
    http_idle_timeout_s: float = 20.0
    http_header_timeout_s: float = 30.0
    http_body_timeout_s: float = 60.0
    http_max_connections: int = 4096  # 0: no limit
    http_max_connections_per_address: int = 1024  # 0: no cap
    http_max_header_bytes: int = 64 * 1024
    http_max_header_fields: int = 128
    # The Responses API's stored responses (service/http/responses_store.py); 0 bytes: none kept
    responses_store_max_bytes: int = 256 << 20
    responses_store_max_age_s: float = 3600.0
    # Cross-origin browser requests (service/http/cors.py): vLLM's flags and defaults, any.
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    http_lora_admin: bool = False  # POST /v1/load_lora_adapter, /v1/unload_lora_adapter (needs an API key)
    tokenizer: str | None = None  # None: fetched from an engine's GetTokenizer
    tool_call_parser: str | None = None  # None: the format the chat template shows (text/tools)
    reasoning_parser: str | None = None  # None: no reasoning split
    max_message_bytes: int = 16 * 1024 * 1024
    max_stop_strings: int = 16
    max_stop_string_chars: int = 1024
    max_n: int = 16
    max_concurrent_calls: int = 1024
    max_calls_per_client: int | None = None  # None: half of max_concurrent_calls; 0: no share (fair_share.py)
    stalled_client_timeout_s: float = 30.0
    max_pending_output_bytes: int = 4 << 20  # per call: past it its engine requests pause (engine/handle.py)
    stream_interval: int = 0  # 0: adaptive coalescing; N: a message waits for N tokens
    # One chat-template render's budget, and the render processes per frontend process (text/chat_template/)
    chat_template_timeout_s: float = TemplateBudget.timeout_s
    chat_template_max_bytes: int = TemplateBudget.max_bytes
    chat_template_workers: int = TemplateBudget.num_workers
    shutdown_timeout: float = 30.0
    workers: int = 1  # frontend processes on one port (service/workers.py)
    tls_cert: str | None = None
    tls_key: str | None = None
    engine_tls_ca: str | None = None
    engine_tls_cert: str | None = None
    engine_tls_key: str | None = None
    api_keys: list[str] = field(default_factory=list)
    api_key_file: str | None = None
    metrics_port: int = 0
    metrics_host: str | None = None  # None: the service's --host
    metrics_client_rate: float = DEFAULT_CLIENT_RATE  # pages/s per address (tandem_common/scrape_ration.py)
    metrics_max_rate: float = DEFAULT_MAX_RATE  # connections/s in all
    ready_file: str | None = None
    log_level: str = "INFO"
    log_format: str = "text"
    otlp_endpoint: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FrontendConfig:
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        values["engines"] = list(values.get("engines") or [])
        values["api_keys"] = list(values.get("api_keys") or [])
        return cls(**values)

    def check(self) -> list[str]:
        """Problems that make the configuration unusable, as messages for the user."""
        problems = []
        if not self.engines:
            problems.append("give at least one --engine HOST:PORT or --engine dns:///NAME:PORT")
        if bool(self.tls_cert) != bool(self.tls_key):
            problems.append("--tls-cert and --tls-key go together")
        if bool(self.engine_tls_cert) != bool(self.engine_tls_key):
            problems.append("--engine-tls-cert and --engine-tls-key go together")
        if self.max_n < 1:
            problems.append("--max-n must be at least 1")
        if self.stream_interval < 0:
            problems.append("--stream-interval must be >= 0 (0: adaptive)")
        if self.max_stop_strings < 0:
            problems.append("--max-stop-strings must be >= 0")
        if self.max_stop_string_chars < 1:
            problems.append("--max-stop-string-chars must be at least 1")
        if self.max_concurrent_calls < 0:
            problems.append("--max-concurrent-calls must be >= 0 (0: no limit)")
        if self.max_calls_per_client is not None and self.max_calls_per_client < 0:
            problems.append("--max-calls-per-client must be >= 0 (0: no per-client limit)")
        if self.stalled_client_timeout_s < 0:
            problems.append("--stalled-client-timeout-s must be >= 0 (0: never)")
        for flag, value in (
            ("--http-idle-timeout-s", self.http_idle_timeout_s),
            ("--http-header-timeout-s", self.http_header_timeout_s),
            ("--http-body-timeout-s", self.http_body_timeout_s),
        ):
            if not 0 < value < math.inf:
                problems.append(f"{flag} must be a positive number of seconds, got {value}")
        if self.http_max_connections < 0 or self.http_max_connections_per_address < 0:
            problems.append("--http-max-connections and --http-max-connections-per-address must be >= 0 (0: no limit)")
        if self.http_max_header_bytes < 1024 or self.http_max_header_fields < 1:
            problems.append("--http-max-header-bytes must be at least 1024 and --http-max-header-fields at least 1")
        if self.responses_store_max_bytes < 0:
            problems.append("--responses-store-max-bytes must be >= 0 (0: no response is stored)")
        if not 0 < self.responses_store_max_age_s < math.inf:
            age = self.responses_store_max_age_s
            problems.append(f"--responses-store-max-age-s must be a positive number of seconds, got {age}")
        if self.max_pending_output_bytes < 64 * 1024:
            problems.append("--max-pending-output-bytes must be at least 65536")
        if self.engine_stall_timeout_s <= 0:
            problems.append("--engine-stall-timeout-s must be positive")
        if self.engine_progress_timeout_s < 0:
            problems.append("--engine-progress-timeout-s must be >= 0 (0: off)")
        if not 0 < self.dns_refresh_s < math.inf:
            problems.append(f"--dns-refresh-s must be a positive number of seconds, got {self.dns_refresh_s}")
        if self.routing_load_threshold < 0:
            problems.append("--routing-load-threshold must be >= 0")
        if self.http_lora_admin and not (self.api_keys or self.api_key_file):
            problems.append("--http-lora-admin needs --api-key or --api-key-file: it loads files on the engines")
        # A blank key would match an empty bearer token (the file is checked at start-up).
        if any(not key.strip() for key in self.api_keys):
            problems.append("--api-key must not be empty or blank")
        return problems

    @property
    def routing_policy(self) -> str:
        """--routing, or its default for these engines."""
        if self.routing is not None:
            return self.routing
        several = len(self.engines) >= 2 or any(e.startswith("dns:") for e in self.engines)
        return "prefix" if several else "least-load"

    @property
    def calls_per_client(self) -> int:
        """--max-calls-per-client, or its default: half of --max-concurrent-calls (0 when that is 0)."""
        if self.max_calls_per_client is not None:
            return self.max_calls_per_client
        return (self.max_concurrent_calls + 1) // 2

    @property
    def template_budget(self) -> TemplateBudget:
        return TemplateBudget(self.chat_template_timeout_s, self.chat_template_max_bytes, self.chat_template_workers)

    @property
    def engine_tls(self) -> bool:
        return bool(self.engine_tls_ca or self.engine_tls_cert)

    def all_api_keys(self) -> list[str]:
        """Keys from --api-key plus one per non-empty, non-comment line of --api-key-file."""
        keys = list(self.api_keys)
        if self.api_key_file:
            for line in Path(self.api_key_file).read_text().splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    keys.append(line)
        return keys


def build_parser() -> argparse.ArgumentParser:
    d = FrontendConfig()
    p = argparse.ArgumentParser(
        prog="tandem-frontend",
        description="Tandem frontend: the public gRPC API (tandem.generate.v1.GenerateService). "
        "Validates, tokenizes, routes each request to an engine and streams text back.",
        formatter_class=HelpFormatter,
    )
    e = p.add_argument_group("engines")
    e.add_argument(
        "--engine",
        dest="engines",
        action="append",
        default=None,
        metavar="HOST:PORT",
        help="engine address; repeat for several engines. dns:///NAME:PORT uses every "
        "address NAME resolves to (e.g. a Kubernetes headless Service)",
    )
    e.add_argument(
        "--dns-refresh-s",
        type=float_in(0.0, lo_open=True),
        default=d.dns_refresh_s,
        help="seconds between re-resolutions of dns:/// engine names",
    )
    e.add_argument(
        "--engine-stall-timeout-s",
        type=float_in(0.0, lo_open=True),
        default=d.engine_stall_timeout_s,
        metavar="S",
        help="an engine that sends nothing and answers no load query for this long is hung: its calls fail "
        "(those that streamed nothing yet are retried on another engine) and it gets no new ones until it "
        "answers again",
    )
    e.add_argument(
        "--engine-progress-timeout-s",
        type=seconds,
        default=d.engine_progress_timeout_s,
        metavar="S",
        help="an engine that answers but advances none of the requests it took for this long (no output, no "
        "change of its load) is not serving: its calls fail with UNAVAILABLE (those that streamed nothing are "
        "retried on another engine) and it gets one request at a time until it advances one (0: off)",
    )
    e.add_argument(
        "--engine-progress-factor",
        type=float_in(0.0),
        default=d.engine_progress_factor,
        metavar="K",
        help="judge an engine against the others: while another engine serves, a request that waits for its "
        "first output, with nothing moving on its engine, K times as long as the slowest serving engine takes "
        "to a first output or between outputs (and at least --engine-progress-floor-s) moves to another engine, "
        "and its engine gets one request at a time until it advances one (0: judge each engine alone, by "
        "--engine-progress-timeout-s)",
    )
    e.add_argument(
        "--engine-progress-floor-s",
        type=float_in(0.0, lo_open=True),
        default=d.engine_progress_floor_s,
        metavar="S",
        help="the least time a request waits on an engine where nothing moves before --engine-progress-factor moves it",
    )
    e.add_argument(
        "--routing",
        choices=["least-load", "prefix"],
        default=None,
        help="how each request picks an engine. least-load: the engine with the fewest queued and "
        "running tokens. prefix: the engine that already caches the longest prefix of the prompt "
        "(engines publish their prefix-cache blocks), unless its load exceeds the least loaded "
        "engine's by --routing-load-threshold. Default: prefix with two or more --engine or a "
        "dns:/// name, least-load with a single engine",
    )
    e.add_argument(
        "--routing-load-threshold",
        type=int_in(0),
        default=d.routing_load_threshold,
        metavar="TOKENS",
        help="--routing prefix: send a request to an engine caching its prefix only while that engine's "
        "queued and running tokens exceed the least loaded engine's by at most this many; beyond it "
        "the prefix's requests spill over to less loaded engines. Lower spreads load, higher "
        "keeps prefixes together; size it to a few steps of an engine's work",
    )
    e.add_argument("--engine-tls-ca", default=None, help="CA (PEM) that engine certificates must chain to; enables TLS")
    e.add_argument("--engine-tls-cert", default=None, help="client certificate (PEM) shown to engines (mutual TLS)")
    e.add_argument("--engine-tls-key", default=None, help="client private key (PEM) for --engine-tls-cert")

    t = p.add_argument_group("model")
    t.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="local tokenizer directory; default: fetched from an engine (GetTokenizer), "
        "each file checked against its sha256",
    )
    t.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(FORMATS),
        metavar="NAME",
        help=f"format of the model's tool calls ({', '.join(FORMATS)}); default: the one the chat "
        "template shows, else json (docs/tools.md)",
    )
    t.add_argument(
        "--reasoning-parser",
        default=None,
        choices=REASONING_PARSERS,
        help="split <think> ... </think> from the answer into reasoning (docs/tools.md); default: off",
    )

    n = p.add_argument_group("server")
    n.add_argument("--host", default=d.host, help="address to listen on")
    n.add_argument("--port", type=port, default=d.port, help="gRPC port (0 picks a free one)")
    add_http_flags(p, d)
    n.add_argument(
        "--max-message-bytes",
        type=message_bytes,
        default=d.max_message_bytes,
        help="gRPC message size limit, for clients and for the streams to the engines: give the engines the same "
        "--max-message-bytes (a request that would not fit an engine stream is refused, RESOURCE_EXHAUSTED)",
    )
    n.add_argument(
        "--ready-file",
        default=None,
        metavar="PATH",
        help="write the port and state (listening; serving while health is SERVING) here as JSON; removed on "
        "exit. For tools that start the frontend, e.g. with --port 0 (see tandem_common/ready.py)",
    )
    n.add_argument(
        "--shutdown-timeout",
        type=seconds,
        default=d.shutdown_timeout,
        help="seconds in-flight calls may take to finish after SIGTERM",
    )
    n.add_argument(
        "--workers",
        type=int_in(1),
        default=d.workers,
        metavar="N",
        help="frontend processes serving the port together (SO_REUSEPORT), each with its own engine streams, "
        "for more tokens/s than one core streams; --metrics-port then serves their metrics summed",
    )
    add_server_tls_flags(n, client_ca=False)
    n.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        default=None,
        metavar="KEY",
        help="accepted API key (repeatable); clients send 'authorization: Bearer KEY'. No key given: no authentication",
    )
    n.add_argument("--api-key-file", default=None, metavar="FILE", help="file with one accepted API key per line")

    r = p.add_argument_group("request limits")
    r.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings, help="most stop strings per request")
    r.add_argument(
        "--max-stop-string-chars",
        type=int_in(1),
        default=d.max_stop_string_chars,
        help="longest stop string, in characters",
    )
    r.add_argument("--max-n", type=int, default=d.max_n, help="largest n (choices per request)")
    r.add_argument(
        "--max-concurrent-calls",
        type=int_in(0),
        default=d.max_concurrent_calls,
        metavar="N",
        help="Generate calls in progress at once; more get RESOURCE_EXHAUSTED (0: no limit)",
    )
    r.add_argument(
        "--max-calls-per-client",
        type=int_in(0),
        default=None,
        metavar="N",
        help="Generate calls one client may have in progress at once (a client is its API key, or its address "
        "without keys); more get RESOURCE_EXHAUSTED. Default: half of --max-concurrent-calls; 0: no limit. "
        "Behind a proxy every caller shares its address: raise it or set 0",
    )
    r.add_argument(
        "--stalled-client-timeout-s",
        type=seconds,
        default=d.stalled_client_timeout_s,
        metavar="S",
        help="a Generate call whose client reads nothing for this long while output waits (gRPC's buffers "
        "for the call are full) is aborted in the engine and ends with RESOURCE_EXHAUSTED; an HTTP connection "
        "whose client reads nothing of its response for this long is closed and its requests aborted (0: never)",
    )
    r.add_argument(
        "--max-pending-output-bytes",
        type=int_in(64 * 1024),
        default=d.max_pending_output_bytes,
        metavar="BYTES",
        help="output of one call (all its choices) that may wait in the frontend for its client to read it; "
        "past it the call's engine requests pause (they give back their KV blocks) until the client reads, so a "
        "slow reader slows only its own call",
    )
    r.add_argument(
        "--chat-template-timeout-s",
        type=float_in(0.0, 3600.0, lo_open=True),
        default=d.chat_template_timeout_s,
        metavar="S",
        help="a chat template (the model's own code) gets this long to render one conversation; past it the "
        "request fails (INVALID_ARGUMENT) and only it, and a template that passes it on the start-up test "
        "conversations is refused at start",
    )
    r.add_argument(
        "--chat-template-max-bytes",
        type=int_in(4096, 1 << 30),
        default=d.chat_template_max_bytes,
        metavar="BYTES",
        help="the most text a chat template may make for one conversation, and so its render process's memory "
        "(256 MiB + 8 x this above what it has at start); past it the request fails (INVALID_ARGUMENT)",
    )
    r.add_argument(
        "--chat-template-workers",
        type=int_in(1, 64),
        default=d.chat_template_workers,
        metavar="N",
        help="chat-template render processes per frontend process: renders run there, never on the event loop; "
        "this many renders stuck at their time budget at once delay the next ones",
    )
    r.add_argument(
        "--stream-interval",
        type=int,
        default=d.stream_interval,
        metavar="N",
        help="0 (default): adaptive, each streamed message carries every token that arrived "
        "while the call's previous message was on its way (one token per message at light "
        "load, several when the frontend is saturated); N: a message waits for N tokens (the "
        "first token and the end are sent at once), 1 sends exactly one message per token",
    )

    add_observability_flags(p, log_level=d.log_level, log_format=d.log_format)
    return p
