"""What a call may hold in the frontend is bounded in bytes, on both faces, against a real pair on 127.0.0.1.

A client that stops reading leaves its call's output waiting in the frontend. Past
--max-pending-output-bytes the frontend pauses the call's requests in the engine (they
stop and give back their KV blocks) instead of merging output without bound; when the
client reads again they resume, and it gets all of its output: a slow reader is slowed,
never failed. The stalled-client timeout is off here, so only the bound acts.
"""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import pytest

from benchmarks.abuse_kit import SMALL_WINDOW
from tandem_protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc
from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tandem_protos.tandem.generate.v1 import generate_pb2_grpc
from tests.rpc.http_face import http_base
from tests.services import start_frontend

N, MAX_TOKENS = 4, 1900  # with 20 top logprobs, ~10 MB of SSE: more than the sockets buffer (~4 MB)


@pytest.fixture(scope="module")
def served(engine_proc):
    extra = ("--http-port", "0", "--max-pending-output-bytes", str(1 << 20), "--stalled-client-timeout-s", "0")
    frontend = start_frontend(engine_proc.address, extra=extra)
    try:
        yield engine_proc, frontend, http_base(frontend)
    finally:
        frontend.terminate()


async def _load(address: str) -> engine_pb2.EngineLoad:
    async with grpc.aio.insecure_channel(address) as channel:
        return (await engine_pb2_grpc.EngineServiceStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=5)).load


async def _until_paused(address: str, timeout: float = 60.0) -> engine_pb2.EngineLoad:
    """The engine's load once every request of the call is paused (AssertionError if never)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        load = await _load(address)
        if load.num_paused == N and load.num_running == load.num_waiting == 0:
            return load
        await asyncio.sleep(0.2)
    raise AssertionError(f"the call's requests never paused in {timeout} s: {load}")  # main: they run to the end


async def test_an_unread_http_stream_pauses_its_requests_and_then_gets_all_of_its_output(served):
    engine, _, base = served
    body = {"prompt": "hello", "max_tokens": MAX_TOKENS, "n": N, "logprobs": 20, "stream": True, "ignore_eos": True}
    async with (
        httpx.AsyncClient(timeout=120) as client,
        client.stream("POST", base + "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        await _until_paused(engine.address)  # nothing read: the frontend holds its bound, the engine waits
        await asyncio.sleep(1)
        assert (await _load(engine.address)).num_running == 0
        tokens, finishes = [0] * N, [None] * N
        async for line in response.aiter_lines():  # reading again: the requests resume
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    tokens[choice["index"]] += len(choice["logprobs"]["tokens"])
                    finishes[choice["index"]] = choice["finish_reason"] or finishes[choice["index"]]
    assert tokens == [MAX_TOKENS] * N and finishes == ["length"] * N


async def test_an_unread_grpc_stream_pauses_its_requests_and_then_gets_all_of_its_output(served):
    engine, frontend, _ = served
    request = g.GenerateRequest(
        text="hello",
        sampling_params=g.SamplingParams(max_tokens=MAX_TOKENS, n=N, logprobs=20, ignore_eos=True),
        return_token_ids=True,
    )
    async with grpc.aio.insecure_channel(frontend.address, options=SMALL_WINDOW) as channel:
        call = generate_pb2_grpc.GenerateServiceStub(channel).Generate(request, timeout=120)
        tokens, finishes = [0] * N, [0] * N
        await _until_paused(engine.address)
        async for response in call:
            tokens[response.index] += len(response.token_ids)
            finishes[response.index] = response.finish_reason or finishes[response.index]
    assert tokens == [MAX_TOKENS] * N and finishes == [g.FINISH_REASON_LENGTH] * N
