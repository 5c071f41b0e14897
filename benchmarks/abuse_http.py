"""Abuse scenarios aimed at the HTTP face, registered in benchmarks.abuse (same command line).

    slowloris-idle       1,024 sockets that never send a byte: another client's status and latency meanwhile,
                         seconds until the frontend closes them
    slowloris-trickle    with --max-concurrent-calls 64, 32 heads sent a line every 2 s and 32 bodies that never
                         come: another client's status and latency, seconds until they are closed, and with what
    unread-http-streams  8 SSE streams (n=16, 2,000 tokens, 20 top logprobs) whose client reads nothing: frontend
                         RSS over time, what the engine does with them, another client's status and latency
    unread-grpc-streams  the same 8 calls over gRPC (a 1 KiB HTTP/2 window)

Each starts a frontend of its own with --http-port 0 beside the pair's engine. Flags that
an older checkout lacks are left out, so this file copied into one measures the code
before a change. The attackers connect from other loopback addresses (127.0.0.2 and up),
so that the victim, from 127.0.0.1, is another client by address too.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time

import grpc
import httpx

from benchmarks.abuse_kit import SMALL_WINDOW, rss_mib
from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tandem_protos.tandem.generate.v1 import generate_pb2_grpc
from tests.rpc.frontend_calls import engine_load
from tests.rpc.http_face import http_base
from tests.services import ROOT, ServiceProcess, start_frontend

UNREAD = {"prompt": "hello", "max_tokens": 2000, "n": 16, "logprobs": 20, "stream": True, "ignore_eos": True}


def _known_flags() -> str:
    return subprocess.run(
        [sys.executable, "-m", "frontend_svc", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60
    ).stdout


def _with_known(args: tuple[str, ...], optional: dict[str, str]) -> tuple[str, ...]:
    """``args`` plus each of ``optional`` (flag -> value) that this checkout's frontend knows."""
    known = _known_flags()
    return args + tuple(a for flag, value in optional.items() if flag in known for a in (flag, value))


async def _http_frontend(pair, *args: str) -> tuple[ServiceProcess, str, int]:
    frontend = start_frontend(pair.engine.address, extra=("--http-port", "0", *args))
    base = await asyncio.to_thread(http_base, frontend)
    return frontend, base, int(base.rsplit(":", 1)[1])


async def _victim(base: str, num: int = 5) -> str:
    """``num`` short completions one after another from 127.0.0.1: their statuses and median latency."""
    statuses, seconds = [], []
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0}
    async with httpx.AsyncClient(timeout=60) as client:
        for _ in range(num):
            t0 = time.monotonic()
            try:
                statuses.append(str((await client.post(base + "/v1/completions", json=body)).status_code))
            except httpx.HTTPError as e:
                statuses.append(type(e).__name__)
            seconds.append(time.monotonic() - t0)
    return f"victim {'/'.join(sorted(set(statuses)))} in {statistics.median(seconds):.2f} s"


def _connect(port: int, source: str) -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    s.setblocking(False)
    return s


def _closed(socks: list[socket.socket], answers: dict[int, bytes]) -> int:
    """How many of ``socks`` the server closed; the first bytes each was answered go to ``answers``."""
    num = 0
    for s in socks:
        if s.fileno() < 0:
            num += 1
            continue
        try:
            while data := s.recv(1 << 16):
                answers.setdefault(id(s), data[:12])
        except BlockingIOError:
            continue
        except OSError:
            pass
        s.close()
        num += 1
    return num


async def _until_closed(socks: list[socket.socket], answers: dict[int, bytes], t0: float, limit_s: float) -> str:
    """How long after ``t0`` the server had closed every one of ``socks`` (given up past ``limit_s``)."""
    while (num := _closed(socks, answers)) < len(socks) and time.monotonic() - t0 < limit_s:
        await asyncio.sleep(0.2)
    seconds = time.monotonic() - t0
    kinds = sorted({a.decode(errors="replace").strip() for a in answers.values()})
    said = f", answered {' '.join(kinds)}" if kinds else ", no answer"
    if num < len(socks):
        return f"{num} of {len(socks)} closed after {seconds:.0f} s (given up){said}"
    return f"all closed after {seconds:.1f} s{said}"


async def slowloris_idle(pair, _stub) -> str:
    frontend, base, port = await _http_frontend(pair)
    socks: list[socket.socket] = []
    try:
        t0 = time.monotonic()
        socks = [_connect(port, f"127.0.0.{2 + i // 512}") for i in range(1024)]
        victim = await _victim(base)
        closed = await _until_closed(socks, {}, t0, 60)
        return f"1024 silent sockets: {victim} while they sit; {closed} (from their connect)"
    finally:
        for s in socks:
            s.close()
        await asyncio.to_thread(frontend.terminate)


async def slowloris_trickle(pair, _stub) -> str:
    args = _with_known(
        ("--max-concurrent-calls", "64"), {"--http-header-timeout-s": "10", "--http-body-timeout-s": "10"}
    )
    frontend, base, port = await _http_frontend(pair, *args)
    heads: list[socket.socket] = []
    bodies: list[socket.socket] = []
    try:
        t0 = time.monotonic()
        for _ in range(32):  # the bodies first: each head is parsed while slots are free
            bodies.append(_connect(port, "127.0.0.3"))
            bodies[-1].send(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 100\r\n\r\n{")
        await asyncio.sleep(0.5)
        for _ in range(32):
            heads.append(_connect(port, "127.0.0.2"))
            heads[-1].send(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\n")
        victim = await _victim(base)
        answers: dict[int, bytes] = {}

        async def trickle() -> None:
            while True:
                await asyncio.sleep(2)
                for s in heads:
                    if s.fileno() >= 0:
                        try:
                            s.send(b"x-slow: 1\r\n")
                        except OSError:
                            pass

        trickling = asyncio.create_task(trickle())
        try:
            closed = await _until_closed(heads + bodies, answers, t0, 90)
        finally:
            trickling.cancel()
        return f"32 trickled heads + 32 stuck bodies, 64 call slots: {victim}; {closed} (from their start)"
    finally:
        for s in heads + bodies:
            s.close()
        await asyncio.to_thread(frontend.terminate)


async def _engine_state(pair) -> str:
    load = await engine_load(pair.engine.address)
    return f"engine {load.num_running} running {load.num_paused} paused"


async def _unread(pair, frontend: ServiceProcess, base: str, open_calls) -> str:
    rss0 = rss_mib(frontend.proc.pid)
    t0 = time.monotonic()
    held = await open_calls()
    figures = []
    try:
        for t in (10, 30, 60):  # the default --stalled-client-timeout-s is 30 s
            await asyncio.sleep(t0 + t - time.monotonic())
            state = await _engine_state(pair)
            figures.append(f"t={t}s RSS +{rss_mib(frontend.proc.pid) - rss0:.0f} MiB, {state}")
            if t == 10:
                figures[-1] += f", {await _victim(base, 3)}"
        return "8 unread calls (n=16, 2000 tokens, 20 logprobs): " + "; ".join(figures)
    finally:
        await held.close()


async def unread_http_streams(pair, _stub) -> str:
    frontend, base, port = await _http_frontend(pair)

    class Held:
        def __init__(self) -> None:
            self.socks = []

        async def close(self) -> None:
            for s in self.socks:
                s.close()

    async def open_calls() -> Held:
        held, body = Held(), json.dumps(UNREAD).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        for _ in range(8):
            s = _connect(port, "127.0.0.2")
            s.setblocking(True)
            s.sendall(head + body)  # and then never read
            held.socks.append(s)
        return held

    try:
        return await _unread(pair, frontend, base, open_calls)
    finally:
        await asyncio.to_thread(frontend.terminate)


async def unread_grpc_streams(pair, _stub) -> str:
    frontend, base, _ = await _http_frontend(pair)

    class Held:
        def __init__(self) -> None:
            self.channel = grpc.aio.insecure_channel(frontend.address, options=SMALL_WINDOW)
            self.calls = []

        async def close(self) -> None:
            for c in self.calls:
                c.cancel()
            await self.channel.close()

    async def open_calls() -> Held:
        held = Held()
        stub = generate_pb2_grpc.GenerateServiceStub(held.channel)
        params = g.SamplingParams(max_tokens=2000, n=16, logprobs=20, ignore_eos=True)
        held.calls = [stub.Generate(g.GenerateRequest(text="hello", sampling_params=params)) for _ in range(8)]
        await asyncio.gather(*(c.read() for c in held.calls))  # one message each, then nothing
        return held

    try:
        return await _unread(pair, frontend, base, open_calls)
    finally:
        await asyncio.to_thread(frontend.terminate)


SCENARIOS = {
    "slowloris-idle": slowloris_idle,
    "slowloris-trickle": slowloris_trickle,
    "unread-http-streams": unread_http_streams,
    "unread-grpc-streams": unread_grpc_streams,
}
