"""Small helpers for calling the frontend's public API in tests."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import grpc

from tandem_protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc
from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tandem_protos.tandem.generate.v1 import generate_pb2_grpc


def stub_of(channel: grpc.aio.Channel) -> generate_pb2_grpc.GenerateServiceStub:
    return generate_pb2_grpc.GenerateServiceStub(channel)


async def generate(
    stub, *, timeout: float = 120, metadata=None, return_token_ids: bool = True, **kw
) -> list[g.GenerateResponse]:
    """One Generate call; ``kw`` holds ``text``/``token_ids``/``messages`` and ``params``."""
    params = kw.pop("params", {})
    if "token_ids" in kw:
        kw["token_ids"] = g.TokenIds(ids=kw["token_ids"])
    request = g.GenerateRequest(sampling_params=g.SamplingParams(**params), return_token_ids=return_token_ids, **kw)
    return [r async for r in stub.Generate(request, timeout=timeout, metadata=metadata)]


def by_choice(responses: list[g.GenerateResponse]) -> dict[int, list[g.GenerateResponse]]:
    choices: dict[int, list[g.GenerateResponse]] = defaultdict(list)
    for r in responses:
        choices[r.index].append(r)
    return dict(choices)


def text_of(responses) -> str:
    return "".join(r.text for r in responses)


def ids_of(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


async def engine_load(engine_address: str) -> engine_pb2.EngineLoad:
    async with grpc.aio.insecure_channel(engine_address) as channel:
        response = await engine_pb2_grpc.EngineServiceStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=5)
        return response.load


async def wait_engine_idle(engine_address: str, timeout: float = 10.0) -> float:
    """Seconds until the engine has nothing running or waiting; fails after ``timeout``."""
    start = time.monotonic()
    while True:
        load = await engine_load(engine_address)
        if load.num_running == 0 and load.num_waiting == 0:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"engine still busy after {timeout} s: {load}")
        await asyncio.sleep(0.05)
