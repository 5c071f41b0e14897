"""The frontend's gRPC server: GenerateService, grpc.health.v1 and reflection.

Start-up: the server listens at once with health NOT_SERVING, connects to the engines
and loads the tokenizer (from --tokenizer, or fetched from the first connected engine),
whose chat template must pass its start-up test (text/chat_template/probe.py). Health is
SERVING while the tokenizer is loaded and at least one engine is connected, NOT_SERVING
otherwise. An engine model without tokenizer.json, or whose chat template cannot serve,
is said once, at ERROR, with what to do (--tokenizer DIR); calls get FAILED_PRECONDITION
with the same words, and the engines are asked again with backoff. A --tokenizer DIR
whose template cannot serve stops the frontend at start, naming the file.

Shutdown (SIGTERM/SIGINT): NOT_SERVING at once, no new calls, in-flight calls get up to
``shutdown_timeout`` seconds to finish, then the server stops (and the template's render
processes with it).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from frontend_svc.config import FrontendConfig
from frontend_svc.engine.channel import engine_credentials
from frontend_svc.engine.router import EngineRouter
from frontend_svc.engine.routing import RoutingPolicy
from frontend_svc.service import servicer as generate
from frontend_svc.service.flow import InFlightCalls
from frontend_svc.service.malformed import MalformedRequestInterceptor
from frontend_svc.service.message_plan import OutputParsers
from frontend_svc.service.metrics import FrontendMetrics
from frontend_svc.service.planning import RequestLimits
from frontend_svc.text.chat_template.probe import TemplateRefused, open_renderer
from frontend_svc.text.chat_template.renderer import ChatRenderer, NoChatTemplate, RenderUnavailable
from frontend_svc.text.tokenizer import Tokenizer
from tandem_common.grpc_options import server_options
from tandem_common.ready import remove_ready_file, remove_stale_ready_file, write_ready_file
from tandem_common.scrape_ration import describe as describe_scrape_limits
from tandem_common.tracing import setup_tracing

if TYPE_CHECKING:
    from frontend_svc.service.http.server import HttpServer

logger = logging.getLogger(__name__)

HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
TOKENIZER_RETRY_S = 1.0  # first retry of a failed tokenizer fetch; doubles up to the cap
TOKENIZER_RETRY_CAP_S = 60.0


class MissingTokenizerError(Exception):
    """The engines hand out no tokenizer.json: the frontend cannot tokenize until its operator acts."""


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Requires ``authorization: Bearer KEY`` (or ``x-api-key: KEY``) with an accepted key.

    Health and reflection stay open so that probes and ``grpcurl list`` work without one.
    """

    OPEN_PREFIXES = (f"/{HEALTH_SERVICE_NAME}/", "/grpc.reflection.")

    def __init__(self, keys: list[str]) -> None:
        self._keys = [k.encode() for k in keys]

    def _authorized(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == "authorization" and value.lower().startswith("bearer "):
                value = value[len("bearer ") :].strip()
            elif key != "x-api-key":
                continue
            if any(hmac.compare_digest(value.encode(), k) for k in self._keys):
                return True
        return False

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(self.OPEN_PREFIXES):
            return handler
        if self._authorized(details.invocation_metadata):
            return handler

        async def deny(request, context):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "a valid API key is required: send metadata 'authorization: Bearer KEY'",
            )

        kind = (handler.request_streaming, handler.response_streaming)
        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[kind]
        return make(
            deny, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )


class FrontendServer:
    def __init__(self, config: FrontendConfig, worker: int | None = None) -> None:
        self.config = config
        self.worker = worker  # one of --workers processes sharing the port (service/workers.py)
        credentials = None
        if config.engine_tls:
            credentials = engine_credentials(config.engine_tls_ca, config.engine_tls_cert, config.engine_tls_key)
        self.router = EngineRouter(
            config.engines,
            dns_refresh_s=config.dns_refresh_s,
            credentials=credentials,
            max_message_bytes=config.max_message_bytes,
            stall_timeout_s=config.engine_stall_timeout_s,
            progress_timeout_s=config.engine_progress_timeout_s,
            progress_factor=config.engine_progress_factor,
            progress_floor_s=config.engine_progress_floor_s,
            policy=RoutingPolicy(config.routing_policy),
            load_threshold_tokens=config.routing_load_threshold,
        )
        self.metrics = FrontendMetrics()
        self.metrics.watch_engines(self.router.engine_figures)
        if self.router.index is not None:
            self.metrics.watch_prefix_index(lambda: self.router.index.num_dropped if self.router.index else 0)
        self.tracer_provider = setup_tracing("tandem-frontend", config.otlp_endpoint)  # None: tracing off
        tracer = self.tracer_provider.get_tracer("frontend_svc") if self.tracer_provider is not None else None
        self.servicer = generate.GenerateServiceServicer(
            self.router,
            limits=RequestLimits(
                max_n=config.max_n,
                max_stop_strings=config.max_stop_strings,
                max_stop_string_chars=config.max_stop_string_chars,
            ),
            calls=InFlightCalls(
                config.max_concurrent_calls,
                config.stalled_client_timeout_s,
                max_calls_per_client=config.calls_per_client,
                keyed=bool(config.api_keys or config.api_key_file),
                max_pending_bytes=config.max_pending_output_bytes,
            ),
            stream_interval=config.stream_interval,
            metrics=self.metrics,
            tracer=tracer,
            parsers=OutputParsers(config.tool_call_parser, config.reasoning_parser),
        )
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._stopping = asyncio.Event()
        self._health_changed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.http: HttpServer | None = None  # the HTTP face's server (--http-port), once started
        self.http_port: int | None = None
        self._serving = False  # what health says; GET /health answers the same

    async def start(self) -> None:
        cfg = self.config
        remove_stale_ready_file(cfg.ready_file)
        if cfg.tokenizer:
            tokenizer = Tokenizer.from_dir(cfg.tokenizer)
            try:
                renderer = await self._open_template(
                    tokenizer, os.path.join(cfg.tokenizer, tokenizer.chat_template_file)
                )
            except (TemplateRefused, RenderUnavailable) as e:
                raise SystemExit(f"--tokenizer {cfg.tokenizer}: {e}") from None
            self.servicer.set_tokenizer(tokenizer, renderer)
            logger.info("tokenizer loaded from %s", cfg.tokenizer)
        try:
            keys = cfg.all_api_keys()
        except OSError as e:
            raise SystemExit(f"cannot read --api-key-file: {e}") from e
        if cfg.api_key_file and len(keys) == len(cfg.api_keys):  # an empty key file must not open the API
            raise SystemExit(
                f"--api-key-file {cfg.api_key_file} holds no key (one per line); "
                "refusing to start without the authentication it asks for"
            )
        # The key check runs first: an unauthenticated caller learns nothing about its request.
        interceptors = [ApiKeyInterceptor(keys)] if keys else []
        interceptors.append(MalformedRequestInterceptor(f"/{generate.SERVICE_NAME}/"))
        options = server_options(cfg.max_message_bytes)
        if self.worker is not None:  # the workers bind one port; the kernel spreads connections over them
            options.append(("grpc.so_reuseport", 1))
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        generate.add_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (generate.SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        await self._set_health(False)
        address = f"{cfg.host}:{cfg.port}"
        if cfg.tls_cert and cfg.tls_key:  # the config holds both or neither
            creds = grpc.ssl_server_credentials([(Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())])
            self.port = self.server.add_secure_port(address, creds)
        else:
            self.port = self.server.add_insecure_port(address)
        await self.server.start()
        logger.info(
            "listening on %s:%d (%s%s), routing %s",
            cfg.host,
            self.port,
            "TLS" if cfg.tls_cert else "plaintext",
            ", API keys required" if keys else "",
            cfg.routing_policy,
        )
        logger.info("calls: %s", self.servicer.calls.describe())
        if cfg.http_port is not None:
            await self._start_http(keys)
        self._write_ready_file(serving=False)
        if cfg.metrics_port:
            host = (cfg.metrics_host or cfg.host).strip("[]")  # never wider than the service itself
            self.metrics.serve(
                cfg.metrics_port, host, client_rate=cfg.metrics_client_rate, max_rate=cfg.metrics_max_rate
            )
            logger.info(
                "metrics on http://%s:%d/metrics (%s)",
                host,
                cfg.metrics_port,
                describe_scrape_limits(cfg.metrics_client_rate, cfg.metrics_max_rate),
            )
        self.router.add_listener(self._health_changed.set)
        self._tasks.append(asyncio.create_task(self._keep_health(), name="health"))
        await self.router.start()
        if self.servicer.tokenizer is None:
            self._tasks.append(asyncio.create_task(self._fetch_tokenizer(), name="tokenizer"))

    async def _start_http(self, keys: list[str]) -> None:
        from frontend_svc.service.http.app import HttpFace
        from frontend_svc.service.http.connection import ConnectionLimits, reserve_file_descriptors
        from frontend_svc.service.http.cors import Cors, with_cors
        from frontend_svc.service.http.responses_store import ResponseStore
        from frontend_svc.service.http.server import Guard, HttpServer, http_requests_counter

        cfg = self.config
        assert cfg.http_port is not None
        responses = ResponseStore(cfg.responses_store_max_bytes, cfg.responses_store_max_age_s)
        face = HttpFace(
            self.servicer.generation,
            serving=lambda: self._serving,
            max_body_bytes=cfg.max_message_bytes,
            responses=responses,
            lora_admin=cfg.http_lora_admin,
        )
        cors = Cors(cfg.allowed_origins, cfg.allowed_methods, cfg.allowed_headers)
        # CORS outermost: a browser's preflight carries no API key and is answered before the Guard asks.
        app = with_cors(Guard(face.app, keys, http_requests_counter(self.metrics.registry)), cors)
        self.http = HttpServer(
            app,
            host=cfg.http_host or cfg.host,
            port=cfg.http_port,
            reuse_port=self.worker is not None,
            tls_cert=cfg.tls_cert,
            tls_key=cfg.tls_key,
            limits=ConnectionLimits(
                idle_timeout_s=cfg.http_idle_timeout_s,
                header_timeout_s=cfg.http_header_timeout_s,
                body_timeout_s=cfg.http_body_timeout_s,
                send_timeout_s=cfg.stalled_client_timeout_s,
                max_connections=cfg.http_max_connections,
                max_connections_per_address=cfg.http_max_connections_per_address,
                max_header_bytes=cfg.http_max_header_bytes,
                max_header_fields=cfg.http_max_header_fields,
            ),
            grace_s=cfg.shutdown_timeout,
        )
        if (problem := reserve_file_descriptors(cfg.http_max_connections)) is not None:
            logger.warning("%s", problem)
        self.http_port = await self.http.start()  # the chosen port with --http-port 0
        logger.info(
            "HTTP API on %s://%s:%d (OpenAI, OpenAI Responses and Anthropic Messages); connections: %s; "
            "stored responses: %s; CORS: %s; LoRA admin: %s",
            "https" if cfg.tls_cert else "http",
            cfg.http_host or cfg.host,
            self.http_port,
            self.http.limits.describe(),
            responses.describe(),
            cors.describe(),
            "on" if cfg.http_lora_admin else "off",
        )

    async def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", generate.SERVICE_NAME):
            await self.health.set(name, status)

    async def _keep_health(self) -> None:
        serving = False
        while True:
            await self._health_changed.wait()
            self._health_changed.clear()
            self.metrics.engines_connected.set(self.router.num_connected)
            self.metrics.engines_refused.set(self.router.num_refused)
            now = self.router.healthy and self.servicer.tokenizer is not None and not self._stopping.is_set()
            if now != serving:
                serving = self._serving = now
                await self._set_health(serving)
                if not self._stopping.is_set():
                    self._write_ready_file(serving)
                logger.info(
                    "health: %s (%d engines connected)",
                    "SERVING" if serving else "NOT_SERVING",
                    self.router.num_connected,
                )

    async def _fetch_tokenizer(self) -> None:
        delay, said = TOKENIZER_RETRY_S, None
        while True:
            await self.router.wait_connected()
            try:
                files = await self.router.fetch_tokenizer_files()
                if "tokenizer.json" not in files:
                    raise MissingTokenizerError(
                        "this frontend has no tokenizer: the engines' model directory has no tokenizer.json (they "
                        f"hand out {', '.join(sorted(files)) or 'no tokenizer files'}). Its operator must restart it "
                        "with --tokenizer DIR, DIR holding the model's tokenizer.json (a Hugging Face tokenizer "
                        "directory), or add tokenizer.json to the engines' model directory"
                    )
                tokenizer = await asyncio.to_thread(Tokenizer.from_files, files)
                renderer = await self._open_template(tokenizer, self._served_template(tokenizer))
            except Exception as e:  # noqa: BLE001 - keep trying; health stays NOT_SERVING meanwhile
                permanent = isinstance(e, (MissingTokenizerError, TemplateRefused))
                self.servicer.tokenizer_problem = str(e) if permanent else None
                # Said once (and again when it changes), then retried quietly with backoff.
                if str(e) != said:
                    said = str(e)
                    if permanent:
                        logger.error("%s", e)
                    else:
                        logger.warning("cannot load the tokenizer from the engines: %s; retrying", e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, TOKENIZER_RETRY_CAP_S)
                continue
            self.servicer.tokenizer_problem = None
            self.servicer.set_tokenizer(tokenizer, renderer)
            if said is not None:
                logger.info("tokenizer loaded from the engines")
            self._health_changed.set()
            return

    async def _open_template(self, tokenizer: Tokenizer, origin: str) -> ChatRenderer:
        """The chat template's renderer, started and tried (TemplateRefused when it cannot serve)."""
        if tokenizer.chat_template is None:
            return NoChatTemplate()
        return await open_renderer(
            tokenizer.chat_template, tokenizer.template_specials, origin, self.config.template_budget
        )

    def _served_template(self, tokenizer: Tokenizer) -> str:
        info = self.router.model_info
        model = f" of model {info.model_name!r}" if info is not None else ""
        return f"{tokenizer.chat_template_file}{model} from the engines (a GGUF file's is its tokenizer.chat_template)"

    def _write_ready_file(self, serving: bool) -> None:
        cfg = self.config
        state = "serving" if serving else "listening"
        write_ready_file(
            cfg.ready_file, service="frontend", host=cfg.host, port=self.port, state=state, http_port=self.http_port
        )

    async def stop(self) -> None:
        self._stopping.set()
        remove_ready_file(self.config.ready_file)
        await self._set_health(False)
        self._serving = False
        stopping = []
        if self.server is not None:
            stopping.append(self.server.stop(grace=self.config.shutdown_timeout))
        if self.http is not None:
            stopping.append(self.http.stop())
        await asyncio.gather(*stopping)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.servicer.calls.close()
        await self.servicer.generation.renderer.close()
        await self.router.close()
        if self.tracer_provider is not None:
            await asyncio.to_thread(self.tracer_provider.shutdown)  # flushes the last spans
        logger.info("stopped")

    async def serve_until_signal(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        await self.start()
        await self._stopping.wait()
        logger.info("shutting down: finishing in-flight calls for up to %.0f s", self.config.shutdown_timeout)
        await self.stop()
