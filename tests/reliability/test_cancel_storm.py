"""500 calls from 50 concurrent clients with random cancellations and deadlines.

Every call ends OK (with all its tokens), CANCELLED or DEADLINE_EXCEEDED; afterwards the
engine runs nothing, queues nothing and holds no KV block, and both services are healthy.
Each call forces its own token with a large logit bias, so a token that reaches the wrong
client shows up as a foreign id.
"""

from __future__ import annotations

import asyncio
import collections
import random

import grpc

from tests.reliability.faults import (
    ENGINE_SERVICE,
    SERVING,
    CallRecord,
    read_call,
    request,
    wait_engine_drained,
    wait_health,
)
from tests.rpc.frontend_calls import generate, stub_of

NUM_CLIENTS = 50
CALLS_PER_CLIENT = 10


def _own_token(i: int) -> int:
    return 3 + i % 2000  # inside the demo vocabulary, below its special tokens


async def _one_call(stub, rng: random.Random, i: int) -> tuple[str, CallRecord]:
    kind = rng.choice(["complete", "complete", "cancel-after-pieces", "cancel-early", "deadline"])
    max_tokens = rng.randint(1, 8) if kind == "complete" else rng.randint(8, 64)
    record = CallRecord(max_tokens=max_tokens)
    timeout = rng.uniform(0.01, 0.6) if kind == "deadline" else 60
    record.call_index = i
    params = dict(max_tokens=max_tokens, n=rng.choice([1, 1, 1, 2]), logit_bias={_own_token(i): 100.0})
    call = stub.Generate(request(f"call {i}", **params), timeout=timeout)
    if kind == "complete" or kind == "deadline":
        return kind, await read_call(call, record)
    if kind == "cancel-early":
        await asyncio.sleep(rng.uniform(0, 0.05))
        call.cancel()
        return kind, await read_call(call, record)
    pieces = rng.randint(1, 3)
    async for response in call:
        record.num_responses += 1
        record.token_ids.extend(response.token_ids)
        if record.num_responses >= pieces:
            call.cancel()
            break
    return kind, await read_call(call, record)


async def test_five_hundred_calls_with_cancels_and_deadlines(shared):
    engine, frontend = shared
    results: list[tuple[str, CallRecord]] = []

    async def client(seed: int) -> None:
        rng = random.Random(seed)
        for i in range(CALLS_PER_CLIENT):
            results.append(await _one_call(stub, rng, seed * 100 + i))

    async with grpc.aio.insecure_channel(frontend.address) as channel:
        stub = stub_of(channel)
        await asyncio.wait_for(asyncio.gather(*(client(s) for s in range(NUM_CLIENTS))), 120)
        assert len(results) == NUM_CLIENTS * CALLS_PER_CLIENT

        codes = collections.Counter((kind, r.code.name) for kind, r in results)
        allowed = {grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}
        assert {r.code for _, r in results} <= allowed, codes
        for kind, r in results:
            if kind == "complete":
                assert r.code == grpc.StatusCode.OK, (kind, r)
            if r.code == grpc.StatusCode.OK and r.completion_tokens is not None:
                assert r.finish_reason and r.completion_tokens == r.max_tokens, (kind, r)
        assert codes[("deadline", "DEADLINE_EXCEEDED")] and codes[("cancel-after-pieces", "CANCELLED")], codes
        foreign = [
            (r.call_index, r.token_ids) for _, r in results if any(t != _own_token(r.call_index) for t in r.token_ids)
        ]
        assert not foreign, f"tokens reached the wrong call: {foreign[:5]}"
        assert sum(len(r.token_ids) for _, r in results) > 500  # the check saw real traffic

        assert await wait_engine_drained(engine.address, timeout=10) < 10
        await wait_health(frontend, SERVING, timeout=5)
        await wait_health(engine, SERVING, timeout=5, service=ENGINE_SERVICE)
        responses = await generate(stub, text="still fine", params=dict(max_tokens=3, ignore_eos=True))
        assert responses[-1].usage.completion_tokens == 3
