"""``--workers N``: N frontend processes serving one port, and the parent that watches them.

    parent ── binds the port (SO_REUSEPORT; --port 0 picks it), holds it until every worker listens
           ── starts N workers (multiprocessing "spawn"): each a whole frontend with its own
              engine streams, calls and limits, listening on the same port (grpc.so_reuseport)
           ── --metrics-port: serves the workers' metrics summed (prometheus-client
              multiprocess mode, PROMETHEUS_MULTIPROC_DIR in a temp dir of this run)
           ── --ready-file: "listening" once every worker listens, "serving" while every worker serves
    SIGTERM / SIGINT ── forwarded to every worker, each drains its calls (--shutdown-timeout)
    a worker that exits on its own ── the others are stopped too and the parent exits 1

The kernel spreads new connections over the workers; a connection (and every call on it)
stays with the worker that accepted it. A dead worker takes the whole service down rather
than being restarted: the orchestrator (Kubernetes, systemd) restarts the process, and a
frontend never serves on with part of its capacity and metrics that forgot a worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from multiprocessing.connection import wait
from pathlib import Path

from frontend_svc.config import FrontendConfig
from tandem_common.parent_death import die_with_parent
from tandem_common.ready import read_ready_file, remove_ready_file, remove_stale_ready_file, write_ready_file
from tandem_common.scrape_ration import describe as describe_scrape_limits

logger = logging.getLogger(__name__)

POLL_S = 0.2  # how often the parent looks at the workers' states
STOP_GRACE_S = 10.0  # past --shutdown-timeout, a worker still running is killed


def run_workers(config: FrontendConfig) -> int:
    """Runs ``config.workers`` workers until a signal (0) or until one of them exits (1)."""
    remove_stale_ready_file(config.ready_file)
    run_dir = Path(tempfile.mkdtemp(prefix="tandem-frontend-"))
    metrics_dir = run_dir / "metrics"
    metrics_dir.mkdir()
    stopping: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: stopping.append(signum)) for sig in _SIGNALS}
    held = _bind(config.host, config.port)
    port = held.getsockname()[1]
    # --http-port: held the same way, so that every worker binds the same HTTP port too.
    held_http = _bind(config.http_host or config.host, config.http_port) if config.http_port is not None else None
    http_port = held_http.getsockname()[1] if held_http is not None else None
    workers: list[multiprocessing.process.BaseProcess] = []
    try:
        if config.metrics_port:
            from frontend_svc.service.metrics import serve_multiprocess

            host = (config.metrics_host or config.host).strip("[]")
            serve_multiprocess(
                config.metrics_port,
                host,
                str(metrics_dir),
                client_rate=config.metrics_client_rate,
                max_rate=config.metrics_max_rate,
            )
            logger.info(
                "metrics of %d workers on http://%s:%d/metrics (%s)",
                config.workers,
                host,
                config.metrics_port,
                describe_scrape_limits(config.metrics_client_rate, config.metrics_max_rate),
            )
        # The workers' metrics go to files there; set before they start, they read it at import.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
        context = multiprocessing.get_context("spawn")
        for i in range(config.workers):
            worker_config = dataclasses.replace(
                config,
                port=port,
                http_port=http_port,
                workers=1,
                metrics_port=0,
                ready_file=str(run_dir / f"ready-{i}.json"),
            )
            process = context.Process(
                target=_worker_main, args=(worker_config, i, os.getpid()), name=f"frontend-worker-{i}"
            )
            process.start()
            workers.append(process)
        logger.info("%d workers on %s:%d: pids %s", len(workers), config.host, port, [w.pid for w in workers])
        return _watch(config, (port, http_port), run_dir, workers, (held, held_http), stopping)
    finally:
        held.close()
        if held_http is not None:
            held_http.close()
        _stop(workers, config.shutdown_timeout + STOP_GRACE_S)
        _forget(workers, metrics_dir)
        remove_ready_file(config.ready_file)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        shutil.rmtree(run_dir, ignore_errors=True)


_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _watch(config, ports, run_dir: Path, workers, held, stopping: list[int]) -> int:
    (port, http_port), state = ports, None
    while not stopping:
        for i, w in enumerate(workers):
            if not w.is_alive():
                logger.error("worker %d (pid %s) exited with code %s; stopping the other workers", i, w.pid, w.exitcode)
                return 1
        states = [(read_ready_file(run_dir / f"ready-{i}.json") or {}).get("state") for i in range(len(workers))]
        now = "serving" if all(s == "serving" for s in states) else "listening" if all(states) else None
        if now is not None and now != state:
            state = now
            for sock in held:
                if sock is not None and sock.fileno() != -1:
                    sock.close()  # every worker listens: the port is theirs
            write_ready_file(
                config.ready_file, service="frontend", host=config.host, port=port, state=state, http_port=http_port
            )
            logger.info("all %d workers %s on %s:%d", len(workers), state, config.host, port)
        wait([w.sentinel for w in workers], timeout=POLL_S)
    logger.info("signal %d: stopping %d workers", stopping[0], len(workers))
    return 0


def _forget(workers, metrics_dir: Path) -> None:
    from frontend_svc.service.metrics import mark_worker_dead

    for w in workers:
        if w.pid is not None and not w.is_alive():
            mark_worker_dead(w.pid, str(metrics_dir))


def _stop(workers, timeout: float) -> None:
    """SIGTERM to every worker still running (each drains its calls), then SIGKILL past ``timeout``."""
    for w in workers:
        if w.is_alive():
            w.terminate()
    deadline = time.monotonic() + timeout
    for w in workers:
        w.join(max(0.0, deadline - time.monotonic()))
        if w.is_alive():
            logger.error("worker pid %s did not stop in %.0f s; killing it", w.pid, timeout)
            w.kill()
            w.join()


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port with SO_REUSEPORT and not listening: it holds the port
    (and with port 0 picks it) for the workers, which bind the same port, until they listen."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise SystemExit(f"cannot bind {host}:{port} for the workers: {e}") from e
    return sock


def _worker_main(config: FrontendConfig, index: int, parent_pid: int) -> None:
    """One worker: a whole frontend on the shared port; its metrics go to the run's files.
    It gets SIGTERM (and drains) if the parent dies, even by SIGKILL."""
    import asyncio

    arm = die_with_parent(parent_pid)
    if arm is not None:
        arm()

    from frontend_svc.service.server import FrontendServer
    from tandem_common.logs import setup_logging

    setup_logging(config.log_level, config.log_format, worker=index)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(FrontendServer(config, worker=index).serve_until_signal())
