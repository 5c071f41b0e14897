"""The public API end to end: a real engine and a real frontend as subprocesses on 127.0.0.1."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tests.rpc.engine_stream import EngineStream
from tests.rpc.frontend_calls import by_choice, generate, ids_of, stub_of, text_of, wait_engine_idle
from tests.services import running_pair, start_frontend

PROMPT = "The capital of France is"
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def services(demo_model_dir):
    with running_pair(demo_model_dir, "--num-kv-blocks", "512") as pair:
        yield pair


@pytest.fixture
async def stub(services):
    async with grpc.aio.insecure_channel(services[1].address) as channel:
        yield stub_of(channel)


@pytest.fixture
def engine_address(services) -> str:
    return services[0].address


async def test_model_info_comes_from_the_engine(stub):
    info = await stub.GetModelInfo(g.GetModelInfoRequest())
    assert info.max_model_len > 0 and info.vocab_size > 0 and info.eos_token_ids
    assert info.has_chat_template and info.num_engines == 1 and info.model_name


async def test_text_prompt_streams_deltas_and_ends_with_usage(stub, engine_address):
    responses = await generate(stub, text=PROMPT, params=dict(max_tokens=12, **GREEDY))
    assert len(responses) > 1 and {r.index for r in responses} == {0}
    *body, last = responses
    assert all(r.finish_reason == g.FINISH_REASON_UNSPECIFIED and not r.HasField("usage") for r in body)
    assert last.finish_reason == g.FINISH_REASON_LENGTH and last.WhichOneof("matched_stop") is None
    ids = ids_of(responses)
    prompt_ids = list((await stub.Tokenize(g.TokenizeRequest(text=PROMPT))).token_ids)
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt_ids), 12) and len(ids) == 12
    assert text_of(responses) == (await stub.Detokenize(g.DetokenizeRequest(token_ids=ids))).text

    # The engine, asked directly with the same tokens, generates the same ones.
    async with grpc.aio.insecure_channel(engine_address) as channel:
        direct = EngineStream(channel)
        result = direct.add("direct", prompt_ids, max_tokens=12, temperature=0.0, ignore_eos=True)
        await direct.wait("direct")
        direct.cancel()
    assert result.token_ids == ids


async def test_stream_interval_sends_fewer_larger_messages(stub, services):
    params = dict(max_tokens=21, **GREEDY)
    every_token = await generate(stub, text=PROMPT, params=params)
    frontend = start_frontend(services[0].address, extra=("--stream-interval", "5"))
    try:
        async with grpc.aio.insecure_channel(frontend.wait_serving().address) as channel:
            batched = await generate(stub_of(channel), text=PROMPT, params=params)
    finally:
        frontend.terminate()
    assert ids_of(batched) == ids_of(every_token) and text_of(batched) == text_of(every_token)
    # The first token goes out at once, then pieces of at least 5 tokens, then the end.
    first, *middle, last = batched
    assert len(first.token_ids) >= 1 and all(len(r.token_ids) >= 5 for r in middle), [len(r.token_ids) for r in batched]
    assert len(batched) <= 6 and last.finish_reason == g.FINISH_REASON_LENGTH


async def test_token_ids_prompt_and_cached_tokens(stub):
    prompt_ids = list((await stub.Tokenize(g.TokenizeRequest(text=PROMPT * 8))).token_ids)
    first = await generate(stub, token_ids=prompt_ids, params=dict(max_tokens=3, **GREEDY))
    second = await generate(stub, token_ids=prompt_ids, params=dict(max_tokens=3, **GREEDY))
    assert ids_of(first) == ids_of(second)
    assert second[-1].usage.prompt_tokens == len(prompt_ids)
    assert second[-1].usage.cached_tokens > 0  # the engine's prefix cache served the repeat


async def test_n_choices_are_indexed_and_seeded(stub):
    params = dict(n=3, seed=7, max_tokens=8, temperature=1.0, ignore_eos=True)
    choices = by_choice(await generate(stub, text=PROMPT, params=params))
    assert sorted(choices) == [0, 1, 2]
    for responses in choices.values():
        assert responses[-1].finish_reason == g.FINISH_REASON_LENGTH and responses[-1].usage.completion_tokens == 8
    again = by_choice(await generate(stub, text=PROMPT, params=params))
    assert {i: ids_of(r) for i, r in again.items()} == {i: ids_of(r) for i, r in choices.items()}
    # Choice i samples with seed + i.
    alone = await generate(stub, text=PROMPT, params=dict(params, n=1, seed=8))
    assert ids_of(alone) == ids_of(choices[1])


async def test_stop_string_cuts_the_text_and_aborts_the_engine_request(stub, engine_address):
    base = text_of(await generate(stub, text=PROMPT, params=dict(max_tokens=60, **GREEDY)))
    stop = base[12:15]
    if len(stop) < 3:
        pytest.skip(f"the demo model wrote too little text: {base!r}")
    cut = base.find(stop)
    responses = await generate(stub, text=PROMPT, params=dict(max_tokens=60, stop=[stop], **GREEDY))
    last = responses[-1]
    assert text_of(responses) == base[:cut]
    assert last.finish_reason == g.FINISH_REASON_STOP and last.stop_str == stop
    assert last.usage.completion_tokens < 60
    await wait_engine_idle(engine_address)

    kept = await generate(
        stub, text=PROMPT, params=dict(max_tokens=60, stop=[stop], include_stop_str_in_output=True, **GREEDY)
    )
    assert text_of(kept) == base[: cut + len(stop)]


async def test_stop_token_ids_end_the_choice(stub):
    ids = ids_of(await generate(stub, text=PROMPT, params=dict(max_tokens=20, **GREEDY)))
    token = ids[6]
    k = ids.index(token)
    responses = await generate(stub, text=PROMPT, params=dict(max_tokens=20, stop_token_ids=[token], **GREEDY))
    last = responses[-1]
    assert last.finish_reason == g.FINISH_REASON_STOP and last.stop_token_id == token
    assert ids_of(responses) == ids[: k + 1] and last.usage.completion_tokens == k + 1


async def test_chat_messages_use_the_chat_template(stub):
    chat = g.ChatMessages(
        messages=[g.ChatMessage(role="system", content="Be brief."), g.ChatMessage(role="user", content="Hello!")]
    )
    tokenized = await stub.Tokenize(g.TokenizeRequest(messages=chat))
    assert len(tokenized.tokens) == len(tokenized.token_ids) > 4
    responses = await generate(stub, messages=chat, params=dict(max_tokens=5, **GREEDY))
    assert responses[-1].usage.prompt_tokens == len(tokenized.token_ids)


async def test_logprobs_and_prompt_logprobs_carry_token_text(stub):
    params = dict(max_tokens=6, logprobs=3, prompt_logprobs=2, n=2, seed=1, temperature=0.0, ignore_eos=True)
    choices = by_choice(await generate(stub, text=PROMPT, params=params))
    prompt_len = choices[0][-1].usage.prompt_tokens
    for index, responses in choices.items():
        logprobs = [lp for r in responses for lp in r.logprobs]
        assert [lp.token_id for lp in logprobs] == ids_of(responses)
        tokens = (await stub.Tokenize(g.TokenizeRequest(text=text_of(responses), add_special_tokens=False))).tokens
        assert all(lp.token for lp in logprobs) or not tokens
        for lp in logprobs:  # greedy: the chosen token is the best one
            assert lp.rank == 1 and len(lp.top) == 3
            assert lp.top[0].token_id == lp.token_id and lp.top[0].token == lp.token
        with_prompt = [r for r in responses if r.prompt_logprobs]
        if index == 0:
            assert with_prompt == responses[:1] and len(responses[0].prompt_logprobs) == prompt_len - 1
        else:
            assert not with_prompt


INVALID = [
    ({"text": ""}, "text"),
    ({}, "input"),
    ({"token_ids": []}, "token_ids.ids"),
    ({"token_ids": [1, 10**7]}, "token_ids.ids"),
    ({"text": "x", "params": {"top_p": 2.0}}, "sampling_params.top_p"),
    ({"text": "x", "params": {"temperature": -1.0}}, "sampling_params.temperature"),
    ({"text": "x", "params": {"n": 0}}, "sampling_params.n"),
    ({"text": "x", "params": {"n": 17}}, "sampling_params.n"),
    ({"text": "x", "params": {"max_tokens": 0}}, "sampling_params.max_tokens"),
    ({"text": "x", "params": {"max_tokens": 4, "min_tokens": 5}}, "sampling_params.min_tokens"),
    ({"text": "x", "params": {"stop": ["a"] * 17}}, "sampling_params.stop"),
    ({"text": "x", "params": {"stop": ["a", ""]}}, "sampling_params.stop[1]"),
    ({"text": "x", "params": {"stop_token_ids": [10**7]}}, "sampling_params.stop_token_ids"),
    ({"text": "x", "params": {"logprobs": 21}}, "sampling_params.logprobs"),
    ({"text": "x", "params": {"logit_bias": {1: 200.0}}}, "sampling_params.logit_bias"),
    ({"text": "x", "params": {"repetition_penalty": 0.0}}, "sampling_params.repetition_penalty"),
    ({"text": "x", "params": {"presence_penalty": 3.0}}, "sampling_params.presence_penalty"),
    ({"text": "x", "params": {"top_k": -2}}, "sampling_params.top_k"),
]


@pytest.mark.parametrize(("request_kw", "field"), INVALID, ids=[f for _, f in INVALID])
async def test_bad_requests_are_invalid_argument_naming_the_field(stub, request_kw, field):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(stub, **request_kw)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(field + ":"), info.value.details()


async def test_max_tokens_beyond_the_context_says_the_numbers(stub):
    info = await stub.GetModelInfo(g.GetModelInfoRequest())
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await generate(stub, token_ids=[5, 6, 7], params=dict(max_tokens=info.max_model_len))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(info.max_model_len) in error.value.details() and "3 tokens" in error.value.details()
    # Unset max_tokens shrinks to the room left instead of failing.
    long_prompt = [5] * (info.max_model_len - 2)
    responses = await generate(stub, token_ids=long_prompt, params=dict(**GREEDY))
    assert responses[-1].usage.completion_tokens == 2 and responses[-1].finish_reason == g.FINISH_REASON_LENGTH


async def test_detokenize_checks_the_vocabulary(stub):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.Detokenize(g.DetokenizeRequest(token_ids=[1, 10**7]))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids[1]" in error.value.details()
    ids = (await stub.Tokenize(g.TokenizeRequest(text="Hello world", add_special_tokens=False))).token_ids
    assert (await stub.Detokenize(g.DetokenizeRequest(token_ids=ids))).text == "Hello world"


async def test_client_cancel_aborts_the_engine_request(stub, engine_address):
    request = g.GenerateRequest(text=PROMPT, sampling_params=g.SamplingParams(max_tokens=1500, **GREEDY))
    call = stub.Generate(request)
    seen = 0
    async for _ in call:
        seen += 1
        if seen == 3:
            break
    call.cancel()
    assert await wait_engine_idle(engine_address, timeout=5) < 5


async def test_deadline_ends_the_call_and_the_engine_request(stub, engine_address):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await generate(stub, timeout=0.5, text=PROMPT, params=dict(max_tokens=1500, **GREEDY))
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_engine_idle(engine_address, timeout=5)


async def test_many_concurrent_calls_each_get_their_own_tokens(stub):
    prompts = [f"{PROMPT} {i}" for i in range(12)]
    singles = [await generate(stub, text=p, params=dict(max_tokens=6, **GREEDY)) for p in prompts[:3]]
    together = await asyncio.gather(*(generate(stub, text=p, params=dict(max_tokens=6, **GREEDY)) for p in prompts))
    for alone, concurrent in zip(singles, together):
        assert ids_of(alone) == ids_of(concurrent)
    assert all(r[-1].usage.completion_tokens == 6 for r in together)
