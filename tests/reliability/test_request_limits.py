"""Every repeated or map field of a request has a documented limit, refused with
INVALID_ARGUMENT naming it, by the frontend and (for what the engine protocol carries) by
the engine; a request the engine stream could not carry is refused alone instead of
killing the stream. (That stop strings cost memory linear in their length is
tests/frontend/test_stop_checker.py's.)"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from frontend_svc.engine import convert as engine_convert
from tandem_common.sampling import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, SamplingParams
from tandem_protos.tandem.engine.v1 import engine_pb2 as pb
from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tests.reliability.faults import CallRecord, read_call, request, wait_engine_drained
from tests.rpc.engine_stream import EngineStream
from tests.rpc.frontend_calls import generate, stub_of
from tests.services import start_engine, start_frontend

MESSAGES_OVER = g.ChatMessages(messages=[g.ChatMessage(role="user", content="hi")] * 1025)

# (request fields, field path, what the message must say); each just over its limit.
OVER_THE_LIMIT = [
    (dict(text="x", params=dict(stop_token_ids=[5] * 129)), "sampling_params.stop_token_ids", "at most 128 ids"),
    (
        dict(text="x", params=dict(logit_bias={i: 1.0 for i in range(1025)})),
        "sampling_params.logit_bias",
        "at most 1024 token ids",
    ),
    (dict(text="x", params=dict(stop=["a"] * 17)), "sampling_params.stop", "at most 16 stop strings"),
    (dict(text="x", params=dict(stop=["ok", "a" * 1025])), "sampling_params.stop[1]", "at most 1024 characters"),
    (dict(messages=MESSAGES_OVER), "messages.messages", "at most 1024 messages"),
    (dict(text="x", request_id="r" * 257), "request_id", "at most 256 characters"),
    (dict(text="x", params=dict(n=17)), "sampling_params.n", "must be in [1, 16]"),
]


@pytest.mark.parametrize(("request_kw", "field", "says"), OVER_THE_LIMIT, ids=[f for _, f, _ in OVER_THE_LIMIT])
async def test_every_repeated_field_has_a_limit(shared, request_kw, field, says):
    engine, frontend = shared
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await generate(stub_of(channel), **request_kw)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith(f"{field}: {says}"), error.value.details()


async def test_the_unary_calls_have_limits_too(shared):
    engine, frontend = shared
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        stub = stub_of(channel)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.Tokenize(g.TokenizeRequest(messages=MESSAGES_OVER))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details().startswith("messages.messages: at most 1024 messages")
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.Detokenize(g.DetokenizeRequest(token_ids=[5] * ((1 << 20) + 1)))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details().startswith("token_ids: at most 1048576 ids")


async def test_the_engine_enforces_the_shared_limits_on_its_own_protocol(shared):
    engine, _ = shared
    async with grpc.aio.insecure_channel(engine.address) as channel:
        stream = EngineStream(channel)
        stream.add("stops", [5, 6, 7], max_tokens=4, stop_token_ids=[9] * (MAX_STOP_TOKEN_IDS + 1))
        stream.add("bias", [5, 6, 7], max_tokens=4, logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)})
        stream.add("fine", [5, 6, 7], max_tokens=4, ignore_eos=True, stop_token_ids=[9] * MAX_STOP_TOKEN_IDS)
        await stream.wait("stops", "bias", "fine")
        for rid, field, says in [
            ("stops", "sampling_params.stop_token_ids", "at most 128 ids"),
            ("bias", "sampling_params.logit_bias", "at most 1024 token ids"),
        ]:
            error = stream.results[rid].error
            assert error is not None and error.code == pb.ERROR_CODE_INVALID_ARGUMENT
            assert error.field == field and says in error.message, error
        assert len(stream.results["fine"].token_ids) == 4
        stream.close()
        await stream.finished()


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (dict(max_tokens=4, min_tokens=5), "sampling_params.min_tokens: must not exceed max_tokens (4), got 5"),
        (dict(logit_bias={10**6: 1.0}), "sampling_params.logit_bias: token id 1000000 is outside the vocabulary"),
        (dict(logit_bias={7: 200.0}), "sampling_params.logit_bias: the bias of token 7 must be in [-100, 100]"),
        (dict(stop_token_ids=[10**6]), "sampling_params.stop_token_ids: token id 1000000 is outside the vocabulary"),
    ],
)
async def test_error_messages_name_the_field_once(shared, params, expected):
    engine, frontend = shared
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await generate(stub_of(channel), text="x", params=params)
    details = error.value.details()
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(expected), details
    name = expected.split(":")[0].split(".")[-1]
    assert details.count(name) == 1, details


async def test_longest_allowed_stops_work_end_to_end(shared):
    engine, frontend = shared
    stops = [f"{i:04d}" + "q" * 1020 for i in range(15)] + ["never" * 200]
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        responses = await generate(
            stub_of(channel), text="hello", params=dict(max_tokens=8, temperature=0.0, ignore_eos=True, stop=stops)
        )
    assert responses[-1].usage.completion_tokens == 8 and responses[-1].finish_reason == g.FINISH_REASON_LENGTH


LIMIT = 2048  # --max-message-bytes of both services in the next test


@pytest.fixture(scope="module")
def small_messages(demo_model_dir):
    engine = start_engine(demo_model_dir, "--num-kv-blocks", "256", "--max-message-bytes", str(LIMIT))
    frontend = None
    try:
        engine.wait_serving()
        frontend = start_frontend(engine.address, extra=("--max-message-bytes", str(LIMIT)))
        yield engine, frontend.wait_serving()
    finally:
        if frontend is not None:
            frontend.terminate()
        engine.terminate()


def _just_under_the_limit() -> g.GenerateRequest:
    """A public request a few bytes under LIMIT whose engine Add is over it: the Add adds a
    request id, an arrival time and explicit sampling defaults."""
    for length in range(LIMIT, 0, -1):
        req = g.GenerateRequest(
            token_ids=g.TokenIds(ids=[5] * length),  # one byte per id
            sampling_params=g.SamplingParams(max_tokens=4, ignore_eos=True),
        )
        if req.ByteSize() < LIMIT - 8:
            break
    add = engine_convert.add_request(
        "0" * 32,
        list(req.token_ids.ids),
        SamplingParams(max_tokens=4, ignore_eos=True),
        priority=0,
        arrival_time=1.7e9,
        trace_context={},
    )
    assert req.ByteSize() < LIMIT < add.ByteSize(), (req.ByteSize(), add.ByteSize())
    return req


async def test_a_request_the_engine_stream_cannot_carry_is_refused_alone(small_messages):
    """Sent, the Add would fail the frontend's shared stream to the engine, and with it
    every call in flight there. It is refused alone; the other call streams to its end."""
    engine, frontend = small_messages
    big = _just_under_the_limit()
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        stub = stub_of(channel)
        started = asyncio.Event()
        other = CallRecord(max_tokens=300)
        reader = asyncio.create_task(read_call(stub.Generate(request("other user", max_tokens=300)), other, started))
        await asyncio.wait_for(started.wait(), 60)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            [r async for r in stub.Generate(big, timeout=60)]
        await asyncio.wait_for(reader, 60)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "bytes the engine stream carries (--max-message-bytes)" in error.value.details()
    assert other.code == grpc.StatusCode.OK and len(other.token_ids) == 300, other
    await wait_engine_drained(engine.address)
