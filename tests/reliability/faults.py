"""Helpers for the fault tests: free ports, health waits, load checks and call records."""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2

from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tests.rpc.frontend_calls import engine_load
from tests.services import ServiceProcess

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE = "tandem.generate.v1.GenerateService"
ENGINE_SERVICE = "tandem.engine.v1.EngineService"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_health(proc: ServiceProcess, status: int, timeout: float = 30.0, service: str = SERVICE) -> float:
    """Seconds until both the server health and the service health read ``status``."""
    start = time.monotonic()
    while True:
        now = [await asyncio.to_thread(proc.health, name) for name in ("", service)]
        if now == [status, status]:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"health {now}, expected {status}:\n{proc.log()[-3000:]}")
        await asyncio.sleep(0.05)


async def wait_engine_drained(address: str, timeout: float = 10.0) -> float:
    """Seconds until the engine runs nothing, queues nothing and holds no KV block."""
    start = time.monotonic()
    while True:
        load = await engine_load(address)
        if load.num_running == 0 and load.num_waiting == 0 and load.num_used_blocks == 0:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"engine {address} not drained after {timeout} s: {load}")
        await asyncio.sleep(0.05)


def request(text: str = "Once upon a time", **params) -> g.GenerateRequest:
    return g.GenerateRequest(
        text=text, return_token_ids=True, sampling_params=g.SamplingParams(temperature=0.0, ignore_eos=True, **params)
    )


@dataclass
class CallRecord:
    """How one Generate call went, as its client saw it."""

    max_tokens: int
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: int = 0
    completion_tokens: int | None = None
    num_responses: int = 0
    ended_at: float = 0.0
    call_index: int = -1  # set by tests that tell their calls apart

    def check_complete_or_explained(self, *explained: grpc.StatusCode) -> None:
        """OK calls hold every token they were promised; the others end with a named status."""
        if self.code == grpc.StatusCode.OK:
            assert self.finish_reason == g.FINISH_REASON_LENGTH, self
            assert self.completion_tokens == self.max_tokens == len(self.token_ids), self
        else:
            assert self.code in explained and self.details, self


async def read_call(call, record: CallRecord, first_piece: asyncio.Event | None = None) -> CallRecord:
    """Reads a Generate call to its end into ``record``; never raises for a status."""
    try:
        async for response in call:
            record.num_responses += 1
            record.token_ids.extend(response.token_ids)
            if first_piece is not None:
                first_piece.set()
            if response.finish_reason:
                record.finish_reason = response.finish_reason
                record.completion_tokens = response.usage.completion_tokens
    except grpc.aio.AioRpcError as e:
        record.code, record.details = e.code(), e.details() or ""
    except asyncio.CancelledError:
        record.code = grpc.StatusCode.CANCELLED
    record.ended_at = time.monotonic()
    return record
