"""What every abuse scenario measures with (benchmarks.abuse, benchmarks.abuse_frontend):
process memory, a victim stream's rate and gaps, a call's final status."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc

from tandem_protos.tandem.generate.v1 import generate_pb2 as g

SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
BIG = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def req(text: str, **params) -> g.GenerateRequest:
    params = {"temperature": 0.0, "ignore_eos": True, **params}
    return g.GenerateRequest(text=text, sampling_params=g.SamplingParams(**params))


class Victim:
    """A long stream read as fast as it comes: message times, for rates and gaps."""

    def __init__(self, stub) -> None:
        self.times: list[float] = []
        self.task = asyncio.create_task(self._read(stub.Generate(req("victim", max_tokens=1900))))

    async def _read(self, call) -> None:
        try:
            async for _ in call:
                self.times.append(time.monotonic())
        except grpc.aio.AioRpcError:
            pass

    def rate(self, start: float, end: float) -> float:
        return sum(start <= t < end for t in self.times) / (end - start)

    def worst_gap(self, start: float, end: float) -> float:
        ts = [start] + [t for t in self.times if start <= t < end] + [end]
        return max(b - a for a, b in zip(ts, ts[1:]))

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def outcome(call) -> tuple[str, float]:
    """(status code name, seconds) of a call read to its end."""
    t0 = time.monotonic()
    try:
        while await call.read() is not grpc.aio.EOF:
            pass
        return "OK", time.monotonic() - t0
    except grpc.aio.AioRpcError as e:
        return e.code().name, time.monotonic() - t0
