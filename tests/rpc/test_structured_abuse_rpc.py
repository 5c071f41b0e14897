"""Structured output fails alone, and cheaply: abusive constraints against a real pair on
127.0.0.1 (engine and frontend subprocesses), each bounded in size and time.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from tandem_common.constraint_cost import MAX_JSON_SCHEMA_DEPTH, MAX_REPEATED_ATOMS
from tandem_protos.tandem.engine.v1 import engine_pb2
from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tests.rpc.engine_stream import EngineStream
from tests.rpc.frontend_calls import generate, stub_of
from tests.services import running_pair

NESTED = '{"a":' * 984 + "1" + "}" * 984  # 5.9 KB


def big_schema(tag: str, num_fields: int = 1000) -> str:
    """A legal ~59 KB schema that keeps a compile thread busy for tenths of a second."""
    props = {f"{tag}_{k}": {"type": "string", "maxLength": k % 50 + 1} for k in range(num_fields)}
    return json.dumps({"type": "object", "properties": props, "required": list(props)})


@pytest.fixture(scope="module")
def pair(demo_model_dir):
    with running_pair(demo_model_dir, "--num-kv-blocks", "256", "--structured-output-timeout-s", "3") as services:
        yield services


@pytest.fixture
async def stub(pair):
    async with grpc.aio.insecure_channel(pair[1].address) as channel:
        yield stub_of(channel)


async def _refused(stub, **constraint) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(generate(stub, text="hi", params=dict(max_tokens=4, **constraint)), 30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return info.value.details()


async def test_a_deeply_nested_schema_is_refused_and_the_engine_serves_on(pair, stub):
    for depth in (984, 10_000):
        schema = '{"a":' * depth + "1" + "}" * depth
        details = await _refused(stub, json_schema=schema)
        assert f"{depth} levels deep; the limit is {MAX_JSON_SCHEMA_DEPTH} levels" in details, details
    # The engine checks too (any client of its protocol can reach it), in band, and goes on.
    async with grpc.aio.insecure_channel(pair[0].address) as channel:
        stream = EngineStream(channel)
        nested = stream.add("nested", [5, 6, 7], max_tokens=4, json_schema=NESTED)
        await stream.wait("nested", timeout=30)
        plain = stream.add("plain", [5, 6, 7], max_tokens=4, temperature=0.0, ignore_eos=True)
        await stream.wait("plain", timeout=30)
        stream.close()
        await stream.finished()
    assert nested.error.code == engine_pb2.ERROR_CODE_INVALID_ARGUMENT and "levels deep" in nested.error.message
    assert len(plain.token_ids) == 4 and plain.error is None


async def test_a_regex_bomb_is_refused_up_front_naming_the_limit(stub):
    limit = f"the limit is {MAX_REPEATED_ATOMS}"
    assert limit in await _refused(stub, regex="(x{1000}){999}")
    assert limit in await _refused(stub, grammar=g.Grammar(text="start: /(x{1000}){999}/"))
    details = await _refused(stub, json_schema='{"type": "string", "pattern": "^(x{1000}){999}$"}')
    assert details.startswith("sampling_params.json_schema: has patterns whose counted repetitions"), details
    many = {f"f{k}": {"type": "string", "pattern": "^(x{100}){50}$"} for k in range(3)}  # 4,999 each
    details = await _refused(stub, json_schema=json.dumps({"type": "object", "properties": many}))
    assert "add 14997 atoms" in details and "for all patterns together" in details, details
    # Counts that stay small pass.
    responses = await generate(stub, text="hi", params=dict(max_tokens=8, temperature=0.0, regex="(x{10}){10}"))
    assert responses[-1].finish_reason == g.FINISH_REASON_LENGTH


async def test_cancelled_compiles_do_not_fail_another_clients_schema(stub):
    """30 distinct 59 KB schemas, each call cancelled after 0.2 s: with their compiles
    queued on two threads, another client's tiny schema used to wait out the 3 s limit
    and fail with INVALID_ARGUMENT. Dropped compiles leave it at most two to wait for."""
    for i in range(30):
        call = stub.Generate(
            g.GenerateRequest(text="x", sampling_params=g.SamplingParams(max_tokens=4, json_schema=big_schema(f"s{i}")))
        )
        await asyncio.sleep(0.2)
        call.cancel()
    tiny = '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}'
    responses = await asyncio.wait_for(
        generate(stub, text="hi", params=dict(max_tokens=16, temperature=0.0, json_schema=tiny)), 30
    )
    assert responses[-1].finish_reason in (g.FINISH_REASON_STOP, g.FINISH_REASON_LENGTH)
