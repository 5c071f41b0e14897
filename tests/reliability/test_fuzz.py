"""Property-based fuzzing of the public API with Hypothesis.

Random field values, huge strings, extreme numbers and token ids whose bytes are not
valid UTF-8: every call must end OK or INVALID_ARGUMENT (never INTERNAL, UNKNOWN or a
hang), and both services must stay healthy and idle afterwards. Hand-made bytes that
parse as no message at all get INVALID_ARGUMENT too, on the frontend and the engine. The number of examples
is bounded so that the module runs in seconds.
"""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tandem_protos.tandem.engine.v1 import engine_pb2 as epb
from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tandem_protos.tandem.generate.v1 import generate_pb2_grpc
from tests.reliability.faults import ENGINE_SERVICE, SERVING, wait_engine_drained, wait_health

U32, I32, U64 = (1 << 32) - 1, (1 << 31) - 1, (1 << 64) - 1
VOCAB = 2048  # the demo model's
MAX_MODEL_LEN = 2048
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
FUZZ = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)

text = st.text(st.characters(codec="utf-8"), max_size=40)
# Far beyond the context (2048 tokens) yet quick to tokenize; test_limits.py goes bigger.
huge_text = st.builds(
    lambda piece, n: (piece * n)[:40_000],
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=8),
    st.integers(1_000, 20_000),
)
extreme_floats = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.sampled_from([-0.0, 1e-45, 1e-30, 100.1, 3.4e38, -3.4e38, math.inf, -math.inf, math.nan]),
)
extreme_u32 = st.one_of(st.integers(0, U32), st.sampled_from([VOCAB, MAX_MODEL_LEN, 1 << 31, U32]))
extreme_i32 = st.one_of(st.integers(-I32 - 1, I32), st.sampled_from([-I32 - 1, -2, I32]))


def mostly(valid: st.SearchStrategy, extreme: st.SearchStrategy, one_in: int = 16) -> st.SearchStrategy:
    """``valid`` values, and now and then an ``extreme`` one, so that most requests get past
    validation and reach the engine while every field still meets its edge cases."""
    return st.integers(0, one_in - 1).flatmap(lambda k: extreme if k == 0 else valid)


def unit(lo: float, hi: float) -> st.SearchStrategy:
    return st.floats(lo, hi)  # float32 on the wire: rounding may land on either side of a bound


token_id = mostly(st.integers(0, VOCAB - 1), extreme_u32)
# Token budgets stay small when valid (generation costs time) and reach the extremes when not.
FIELDS = {
    "max_tokens": mostly(st.integers(1, 4), st.one_of(st.just(0), extreme_u32)),
    "n": mostly(st.integers(1, 3), st.one_of(st.just(0), st.integers(17, U32))),
    "logprobs": mostly(st.integers(0, 5), st.integers(21, U32)),
    "prompt_logprobs": mostly(st.integers(0, 3), st.integers(21, U32)),
    "temperature": mostly(st.one_of(st.just(0.0), unit(0.0, 2.0)), extreme_floats),
    "top_p": mostly(unit(0.01, 1.0), extreme_floats),
    "repetition_penalty": mostly(unit(0.5, 2.0), extreme_floats),
    "seed": st.integers(0, U64),
    "skip_special_tokens": st.booleans(),
    "min_tokens": mostly(st.integers(0, 1), extreme_u32),
    "top_k": mostly(st.integers(-1, 50), extreme_i32),
    "min_p": mostly(unit(0.0, 1.0), extreme_floats),
    "presence_penalty": mostly(unit(-2.0, 2.0), extreme_floats),
    "frequency_penalty": mostly(unit(-2.0, 2.0), extreme_floats),
    "include_stop_str_in_output": st.booleans(),
    "ignore_eos": st.booleans(),
}


@st.composite
def sampling_params(draw) -> g.SamplingParams:
    p = g.SamplingParams()
    for name, strategy in FIELDS.items():
        # max_tokens left unset means 16 tokens per choice: seldom, to keep examples quick.
        if draw(mostly(st.just(True), st.just(False), 8) if name == "max_tokens" else st.booleans()):
            setattr(p, name, draw(strategy))
    p.stop.extend(
        draw(
            st.lists(
                mostly(text.filter(bool), st.one_of(st.just(""), huge_text)),
                max_size=draw(mostly(st.just(3), st.just(20))),
            )
        )
    )
    p.stop_token_ids.extend(draw(st.lists(token_id, max_size=4)))
    for key, value in draw(st.dictionaries(token_id, mostly(unit(-100.0, 100.0), extreme_floats), max_size=4)).items():
        p.logit_bias[key] = value
    return p


@st.composite
def chat(draw) -> g.ChatMessages:
    role = mostly(st.sampled_from(["system", "user", "assistant"]), text)
    content = mostly(text, huge_text)
    chat = g.ChatMessages(
        messages=draw(
            st.lists(
                st.builds(g.ChatMessage, role=role, content=content),
                min_size=draw(mostly(st.just(1), st.just(0))),
                max_size=4,
            )
        )
    )
    if draw(st.booleans()):
        chat.add_generation_prompt = draw(st.booleans())
    return chat


@st.composite
def generate_requests(draw) -> g.GenerateRequest:
    request = g.GenerateRequest(
        sampling_params=draw(sampling_params()),
        return_token_ids=draw(st.booleans()),
        request_id=draw(text),
        priority=draw(mostly(st.integers(-5, 5), extreme_i32)),
    )
    kind = draw(mostly(st.sampled_from(["text", "token_ids", "messages"]), st.sampled_from(["huge_text", "none"])))
    if kind == "text":
        request.text = draw(mostly(text.filter(bool), st.just("")))
    elif kind == "huge_text":
        request.text = draw(huge_text)
    elif kind == "token_ids":
        request.token_ids.ids.extend(
            draw(st.lists(token_id, min_size=draw(mostly(st.just(1), st.just(0))), max_size=64))
        )
    elif kind == "messages":
        request.messages.CopyFrom(draw(chat()))
    if draw(st.booleans()):
        request.add_special_tokens = draw(st.booleans())
    return request


@pytest.fixture(scope="module")
def stub(shared):
    with grpc.insecure_channel(shared[1].address) as channel:
        yield generate_pb2_grpc.GenerateServiceStub(channel)


def _status(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as e:
        assert e.code() in ALLOWED, (e.code(), e.details())
        assert e.details(), e.code()
        event(f"{e.code().name} {e.details().split(':')[0]}")
        return e.code()
    event("OK")
    return grpc.StatusCode.OK


def _check_stream(responses: list[g.GenerateResponse], request: g.GenerateRequest) -> None:
    finals = [r for r in responses if r.finish_reason]
    n = request.sampling_params.n if request.sampling_params.HasField("n") else 1
    assert sorted(r.index for r in finals) == list(range(n)), finals
    for r in finals:
        assert r.finish_reason in (g.FINISH_REASON_STOP, g.FINISH_REASON_LENGTH), r
        assert r.HasField("usage") and r.usage.prompt_tokens > 0


@FUZZ
@given(request=generate_requests())
def test_generate_answers_ok_or_invalid_argument(stub, request):
    responses: list[g.GenerateResponse] = []
    if _status(lambda: responses.extend(stub.Generate(request, timeout=120))) == grpc.StatusCode.OK:
        _check_stream(responses, request)


@FUZZ
@given(
    data=st.one_of(
        st.builds(
            lambda t, a: g.TokenizeRequest(text=t, add_special_tokens=a), mostly(text, huge_text, 4), st.booleans()
        ),
        st.builds(lambda c: g.TokenizeRequest(messages=c), chat()),
        st.just(g.TokenizeRequest()),
    )
)
def test_tokenize_answers_ok_or_invalid_argument(stub, data):
    _status(lambda: stub.Tokenize(data, timeout=60))


@FUZZ
@given(ids=st.lists(token_id, max_size=64), skip=st.one_of(st.none(), st.booleans()))
def test_detokenize_then_tokenize_round_trips_any_ids(stub, ids, skip):
    """Ids whose bytes are no valid UTF-8 (lone byte tokens, cut multi-byte characters)
    decode with replacement characters, and that text tokenizes again."""
    request = g.DetokenizeRequest(token_ids=ids)
    if skip is not None:
        request.skip_special_tokens = skip
    result: list[g.DetokenizeResponse] = []
    code = _status(lambda: result.append(stub.Detokenize(request, timeout=60)))
    if any(t >= VOCAB for t in ids):
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        return
    assert code == grpc.StatusCode.OK
    again = stub.Tokenize(g.TokenizeRequest(text=result[0].text, add_special_tokens=False), timeout=60)
    assert len(again.token_ids) == len(again.tokens)


def test_lone_byte_tokens_round_trip(stub):
    """Byte-level vocabularies hold one token per byte; a byte >= 0x80 alone is no UTF-8."""
    lone = [t for t in range(VOCAB) if stub.Detokenize(g.DetokenizeRequest(token_ids=[t])).text == "\ufffd"]
    assert lone, "the vocabulary has no lone-byte tokens"
    word = list(stub.Tokenize(g.TokenizeRequest(text="né", add_special_tokens=False)).token_ids)
    for probe in ([lone[0]], lone[:3], word + lone[:1] + word, lone[-1:] + word):
        text = stub.Detokenize(g.DetokenizeRequest(token_ids=probe)).text
        assert "\ufffd" in text and "né" * probe.count(word[0]) in text.replace("\ufffd", "")
        again = stub.Tokenize(g.TokenizeRequest(text=text, add_special_tokens=False)).token_ids
        assert again and stub.Detokenize(g.DetokenizeRequest(token_ids=again)).text == text


@pytest.mark.parametrize(
    "method, payload",
    [
        ("Tokenize", b"\x0a\x02\xff\xfe"),  # text = two bytes that are no UTF-8
        ("Generate", b"\x0a\x03\xc3\x28\x41"),  # text = an invalid two-byte sequence
        ("Generate", b"\x22\x05\x5a\x03\xed\xa0\x80"),  # sampling_params.stop[0] = an encoded surrogate
        ("Detokenize", b"\x0a\x03\x80\x80\x80"),  # token_ids: a truncated varint
        ("GetModelInfo", b"\xff\xff\xff\xff"),  # no message at all
    ],
)
def test_undecodable_messages_are_invalid_argument(shared, method, payload):
    """Bytes that no protobuf library would produce (a hand-written or broken client)."""
    with grpc.insecure_channel(shared[1].address) as channel:
        path = f"/tandem.generate.v1.GenerateService/{method}"
        call = channel.unary_stream(path) if method == "Generate" else channel.unary_unary(path)
        with pytest.raises(grpc.RpcError) as error:
            result = call(payload, timeout=10)
            list(result) if method == "Generate" else result
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    assert "could not be parsed" in error.value.details()


@pytest.mark.parametrize("busy", [False, True], ids=["idle-stream", "busy-stream"])
async def test_malformed_engine_control_message_ends_only_its_stream(shared, busy):
    """The engine's stream fails with INVALID_ARGUMENT at once, whether or not a step output
    is due, its requests are aborted, and the engine serves on."""
    engine, _ = shared
    good = epb.StreamRequest(
        add=epb.Add(
            request_id="running",
            prompt_token_ids=[5, 6, 7],
            sampling_params=epb.SamplingParams(max_tokens=1500, ignore_eos=True),
        )
    )
    bad = b"\x0a\x04\x0a\x02\xff\xfe"  # add { request_id: two bytes that are no UTF-8 }
    outbox: asyncio.Queue = asyncio.Queue()

    async def messages():
        while (message := await outbox.get()) is not None:
            yield message

    async with grpc.aio.insecure_channel(engine.address) as channel:
        call = channel.stream_stream("/tandem.engine.v1.EngineService/Stream")(messages(), timeout=30)
        outbox.put_nowait(good.SerializeToString() if busy else bad)
        sent_bad = not busy
        with pytest.raises(grpc.aio.AioRpcError) as error:
            async for _ in call:
                # Once, while "running" decodes: a write after the engine has ended the stream
                # fails on the client's side, and gRPC reports that (INTERNAL) instead.
                if not sent_bad:
                    outbox.put_nowait(bad)
                    sent_bad = True
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details().startswith("malformed control message:")
    await wait_engine_drained(engine.address, timeout=5)
    await wait_health(engine, SERVING, timeout=5, service=ENGINE_SERVICE)


async def test_services_are_healthy_and_idle_after_the_fuzzing(shared):
    engine, frontend = shared
    await wait_health(frontend, SERVING, timeout=5)
    await wait_health(engine, SERVING, timeout=5, service=ENGINE_SERVICE)
    await wait_engine_drained(engine.address, timeout=10)
    assert "Traceback" not in frontend.log() and "Traceback" not in engine.log()
