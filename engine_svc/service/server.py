"""The engine's gRPC server: EngineService, grpc.health.v1 and reflection.

Start-up: the server listens at once with health NOT_SERVING, loads the weights and runs
a warm-up step off the event loop, then turns SERVING. Shutdown (SIGTERM/SIGINT):
NOT_SERVING at once, new adds get in-band UNAVAILABLE, running requests get up to
``shutdown_timeout`` seconds to finish, the rest are aborted, then the server stops. An
engine whose loop died has no request that can finish (every stream ended with it), so its
shutdown waits for none.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine_svc.config import EngineConfig
from engine_svc.service.engine_loop import EngineLoop
from engine_svc.service.servicer import EngineServicer, LoadedEngine
from engine_svc.types import ErrorCode, RequestError
from tandem_common.grpc_options import server_options
from tandem_common.ready import remove_ready_file, remove_stale_ready_file, write_ready_file
from tandem_common.scrape_ration import describe as describe_scrape_limits
from tandem_common.tracing import setup_tracing
from tandem_protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

logger = logging.getLogger(__name__)

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name


def server_credentials(cert: str | None, key: str | None, ca: str | None) -> grpc.ServerCredentials | None:
    if not cert:
        if key or ca:  # never fall back to plaintext when TLS was asked for
            raise SystemExit("--tls-key and --tls-ca need --tls-cert")
        return None
    if not key:
        raise SystemExit("--tls-cert needs --tls-key")
    root = Path(ca).read_bytes() if ca else None
    return grpc.ssl_server_credentials(
        [(Path(key).read_bytes(), Path(cert).read_bytes())],
        root_certificates=root,
        require_client_auth=root is not None,
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class EngineServer:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.servicer = EngineServicer(
            max_message_bytes=config.max_message_bytes, stream_backlog_bytes=config.stream_backlog_bytes
        )
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.engine: EngineLoop | None = None  # set once the model is loaded
        self.tracer_provider: TracerProvider | None = None  # set when tracing is on
        self.port = 0
        self._stopping = asyncio.Event()

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            result = self.health.set(name, status)
            if asyncio.iscoroutine(result):
                await result

    async def start(self) -> None:
        cfg = self.config
        remove_stale_ready_file(cfg.ready_file)
        self.server = grpc.aio.server(options=server_options(cfg.max_message_bytes))
        engine_pb2_grpc.add_EngineServiceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server,
        )
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{cfg.host}:{cfg.port}"
        creds = server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
        self.port = self.server.add_secure_port(address, creds) if creds else self.server.add_insecure_port(address)
        await self.server.start()
        logger.info("listening on %s:%d (%s)", cfg.host, self.port, "TLS" if creds else "plaintext")
        write_ready_file(cfg.ready_file, service="engine", host=cfg.host, port=self.port, state="listening")
        if not (creds is not None and cfg.tls_ca) and not _is_loopback(cfg.host):
            # Server-only TLS encrypts but lets any client in: the same exposure as plaintext.
            how = "without TLS" if creds is None else "with TLS but without client certificates (--tls-ca)"
            logger.warning(
                "the engine listens on %s %s: anyone who can reach this port can generate text "
                "and read the tokenizer. Use mutual TLS (--tls-cert/--tls-key/--tls-ca) or restrict the port "
                "to frontends (the Helm chart's NetworkPolicy does this).",
                cfg.host,
                how,
            )

    async def load(self) -> None:
        """Load the model and warm up off the event loop, then turn SERVING."""
        from engine_svc.core import EngineCore

        cfg = self.config
        t0 = time.perf_counter()

        def build() -> EngineCore:
            core = EngineCore(cfg)
            core.warmup()
            return core

        engine = EngineLoop()
        # Built on the thread that will step it (see engine_loop.py on OpenMP pools).
        await asyncio.to_thread(engine.start, build)
        core = engine.core
        assert core is not None  # start(build) returned: the core is built
        self.engine = engine
        self._observe(engine, core.model_name)
        self.servicer.attach(LoadedEngine(engine, core.model_info(), core.model_dir))
        loop = asyncio.get_running_loop()

        def on_failure(_: BaseException) -> None:  # on the dying engine thread
            asyncio.run_coroutine_threadsafe(self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING), loop)

        engine.on_failure = on_failure
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        write_ready_file(cfg.ready_file, service="engine", host=cfg.host, port=self.port, state="serving")
        logger.info("serving (ready %.2f s after start of loading)", time.perf_counter() - t0)

    def _observe(self, engine: EngineLoop, model_name: str) -> None:
        """Metrics and tracing, each only when turned on (otherwise nothing is attached)."""
        cfg = self.config
        if cfg.metrics_port:
            from engine_svc.service.metrics import EngineMetrics

            host = (cfg.metrics_host or cfg.host).strip("[]")  # never wider than the service itself
            metrics = EngineMetrics(
                cfg.metrics_port, host=host, client_rate=cfg.metrics_client_rate, max_rate=cfg.metrics_max_rate
            )
            metrics.attach(engine)
            logger.info(
                "metrics on http://%s:%d/metrics (%s)",
                host,
                cfg.metrics_port,
                describe_scrape_limits(cfg.metrics_client_rate, cfg.metrics_max_rate),
            )
        self.tracer_provider = setup_tracing("tandem-engine", cfg.otlp_endpoint)
        if self.tracer_provider is not None:
            from engine_svc.service.tracing import RequestTracer

            engine.add_listener(RequestTracer(self.tracer_provider.get_tracer("engine_svc"), model_name))

    async def drain_and_stop(self) -> None:
        cfg = self.config
        remove_ready_file(cfg.ready_file)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.engine is not None:
            await self._drain_requests(self.engine)
            await self.servicer.close_streams(timeout=5.0)
        if self.server is not None:
            await self.server.stop(grace=1.0)
        if self.engine is not None:
            self.engine.stop()
        if self.tracer_provider is not None:
            await asyncio.to_thread(self.tracer_provider.shutdown)  # flushes the last spans
        logger.info("stopped")

    async def _drain_requests(self, engine: EngineLoop) -> None:
        """Running requests get up to ``shutdown_timeout`` seconds to finish, then are aborted.

        A loop that died finishes nothing more (its streams ended when it died, each call
        UNAVAILABLE), so the wait ends as soon as the loop is found dead, before or during it.
        """
        engine.start_draining()
        deadline = time.monotonic() + self.config.shutdown_timeout
        while engine.num_unfinished() and engine.failure is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if engine.failure is not None:
            logger.warning("the engine loop is dead: no request can finish, so shutdown waits for none")
            return
        left = engine.num_unfinished()
        if left:
            logger.warning("shutdown timeout: aborting %d unfinished requests", left)
            engine.fail_all(
                RequestError(
                    ErrorCode.UNAVAILABLE,
                    "the engine shut down before this request finished (shutdown timeout); retry on another engine",
                )
            )

    def request_stop(self) -> None:
        self._stopping.set()

    async def serve_until_signal(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        await self.start()
        load_task = asyncio.create_task(self.load())
        stop_task = asyncio.create_task(self._stopping.wait())
        done, _ = await asyncio.wait({load_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if load_task in done and load_task.exception() is not None:
            logger.error("failed to load the model: %s", load_task.exception())
            remove_ready_file(self.config.ready_file)
            assert self.server is not None  # start() made it
            await self.server.stop(grace=None)
            raise SystemExit(1)
        await stop_task
        if not load_task.done():
            load_task.cancel()
        logger.info("shutting down: draining up to %.0f s", self.config.shutdown_timeout)
        await self.drain_and_stop()
