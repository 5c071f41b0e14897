"""Structured output through the public API and the engine stream: real services on 127.0.0.1.

Streams are concatenated as a client would; every finished output must pass the same
independent checkers as the engine-level tests (tests/structured_cases.py).
"""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.request

import grpc
import pytest
from google.protobuf import json_format
from prometheus_client.parser import text_string_to_metric_families

from tandem_common.sampling import MAX_STRUCTURED_BYTES
from tandem_protos.tandem.engine.v1 import engine_pb2
from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tests.grpcurl import grpcurl
from tests.interop.jsonstream import json_objects
from tests.rpc.engine_stream import EngineStream
from tests.rpc.frontend_calls import by_choice, generate, stub_of, text_of
from tests.services import running_pair, start_engine
from tests.structured_cases import ARITHMETIC, CHOICES, REGEX, SCHEMA, VALID

CONSTRAINTS = {
    "json_schema": dict(json_schema=json.dumps(SCHEMA)),
    "regex": dict(regex=REGEX),
    "choice": dict(choice=g.Choice(choices=CHOICES)),
    "grammar": dict(grammar=g.Grammar(syntax=g.GRAMMAR_SYNTAX_LARK, text=ARITHMETIC)),
}
PROMPTS = [f"Order {i}: list the items of shipment {i * 13}, please" for i in range(4)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def services(demo_model_dir):
    metrics_port = _free_port()
    with running_pair(demo_model_dir, "--num-kv-blocks", "512", "--metrics-port", str(metrics_port)) as pair:
        yield (*pair, f"http://127.0.0.1:{metrics_port}/metrics")


@pytest.fixture
async def stub(services):
    async with grpc.aio.insecure_channel(services[1].address) as channel:
        yield stub_of(channel)


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _finished(responses) -> tuple[str, int]:
    return text_of(responses), responses[-1].finish_reason


async def test_every_kind_greedy_and_seeded_streams_valid_output(stub, services):
    calls = {
        (kind, prompt, temperature): generate(
            stub, text=prompt, params=dict(max_tokens=80, temperature=temperature, seed=7, **constraint)
        )
        for kind, constraint in CONSTRAINTS.items()
        for prompt in PROMPTS
        for temperature in (0.0, 1.0)
    }
    results = dict(zip(calls, await asyncio.gather(*calls.values())))
    for (kind, prompt, temperature), responses in results.items():
        text, finish = _finished(responses)
        if finish == g.FINISH_REASON_STOP:
            assert VALID[kind](text), (kind, prompt, temperature, text)
            assert responses[-1].stop_token_id in (await stub.GetModelInfo(g.GetModelInfoRequest())).eos_token_ids
        else:  # unbounded JSON fractions and arithmetic may reach max_tokens
            assert finish == g.FINISH_REASON_LENGTH and kind in ("json_schema", "grammar"), (kind, text)
    stopped = sum(r[-1].finish_reason == g.FINISH_REASON_STOP for r in results.values())
    assert stopped >= len(results) * 3 // 4

    metrics = _metrics(services[2])
    for kind in CONSTRAINTS:
        assert metrics[("tandem_engine_structured_requests_total", (("kind", kind),))] >= 8
    # One compile per constraint; the seven other requests of each found it cached or compiling.
    assert metrics[("tandem_engine_structured_compile_duration_seconds_count", ())] >= 4
    assert metrics[("tandem_engine_structured_cache_hits_total", ())] >= 1


async def test_n_3_gives_three_valid_choices(stub):
    responses = await generate(
        stub, text=PROMPTS[0], params=dict(n=3, max_tokens=80, temperature=1.0, seed=11, **CONSTRAINTS["json_schema"])
    )
    choices = by_choice(responses)
    assert sorted(choices) == [0, 1, 2]
    texts = [text_of(c) for c in choices.values() if c[-1].finish_reason == g.FINISH_REASON_STOP]
    assert texts and all(VALID["json_schema"](t) for t in texts), texts
    assert len(set(text_of(c) for c in choices.values())) > 1  # seed + i per choice


async def test_a_stop_string_cuts_a_constrained_output(stub):
    responses = await generate(
        stub, text=PROMPTS[1], params=dict(max_tokens=20, temperature=0.0, regex="[a-z]{3}-[0-9]{3}", stop=["-"])
    )
    last = responses[-1]
    assert last.finish_reason == g.FINISH_REASON_STOP and last.stop_str == "-"
    assert len(text_of(responses)) == 3 and text_of(responses).isalpha()


async def test_a_prefix_cache_hit_gives_the_same_valid_output(stub):
    params = dict(max_tokens=16, temperature=0.0, **CONSTRAINTS["regex"])
    prompt = "A long shared system prompt that spans more than one KV block of sixteen tokens: " + PROMPTS[2]
    first = await generate(stub, text=prompt, params=params)
    second = await generate(stub, text=prompt, params=params)
    assert second[-1].usage.cached_tokens > 0 and first[-1].usage.cached_tokens == 0
    assert text_of(first) == text_of(second)
    assert second[-1].finish_reason == g.FINISH_REASON_STOP and VALID["regex"](text_of(second))


async def test_a_chat_request_takes_the_same_constraint(stub):
    messages = g.ChatMessages(messages=[g.ChatMessage(role="user", content="Pick a colour.")])
    responses = await generate(
        stub, messages=messages, params=dict(max_tokens=10, temperature=0.0, **CONSTRAINTS["choice"])
    )
    assert responses[-1].finish_reason == g.FINISH_REASON_STOP and text_of(responses) in CHOICES


async def test_a_constraint_that_does_not_compile_fails_its_call_alone(stub):
    bad = {
        "json_schema": dict(json_schema='{"type": "object", "properties": {"a": {"type": "strng"}}}'),
        "regex": dict(regex="(unclosed"),
        "grammar": dict(grammar=g.Grammar(text="start: missing_rule\n")),
    }
    calls = [generate(stub, text=PROMPTS[0], params=dict(max_tokens=8, **b)) for b in bad.values()]
    calls.append(generate(stub, text=PROMPTS[0], params=dict(max_tokens=8, temperature=0.0, ignore_eos=True)))
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    good = outcomes.pop()
    assert not isinstance(good, BaseException) and good[-1].usage.completion_tokens == 8
    for (name, _), error in zip(bad.items(), outcomes):
        assert isinstance(error, grpc.aio.AioRpcError), (name, error)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, error.details())
        assert error.details().startswith(f"sampling_params.{name}: "), error.details()
    details = [e.details() for e in outcomes]
    assert "Invalid type: strng" in details[0]
    assert "unclosed group" in details[1]
    assert 'unknown name: "missing_rule"' in details[2]


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(json_schema=""), "sampling_params.json_schema: the JSON schema is empty"),
        (dict(json_schema="{'type': 'object'}"), "sampling_params.json_schema: is not valid JSON: Expecting property"),
        (
            dict(json_schema="[1, 2]"),
            "sampling_params.json_schema: must be a JSON object (a JSON Schema), got an array",
        ),
        (dict(regex=""), "sampling_params.regex: the regex is empty"),
        (dict(choice=g.Choice()), "sampling_params.choice.choices: the list of choices is empty"),
        (dict(choice=g.Choice(choices=["a", ""])), "sampling_params.choice.choices[1]: is empty"),
        (dict(grammar=g.Grammar(text="")), "sampling_params.grammar.text: the grammar is empty"),
        (dict(regex="a" * (MAX_STRUCTURED_BYTES + 1)), f"the limit is {MAX_STRUCTURED_BYTES} bytes"),
    ],
)
async def test_the_frontend_refuses_malformed_constraints(stub, params, message):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(stub, text="hi", params=params)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details(), info.value.details()


async def test_without_a_constraint_the_same_prompts_fail_every_check(stub):
    calls = [generate(stub, text=p, params=dict(max_tokens=24, temperature=t, seed=7)) for p in PROMPTS for t in (0, 1)]
    texts = [text_of(r) for r in await asyncio.gather(*calls)]
    assert not [(kind, t) for kind, valid in VALID.items() for t in texts if valid(t)]


@pytest.fixture(scope="module")
def tight(demo_model_dir):
    """A pair whose KV pool (26 blocks of 8 tokens) holds two of these requests, not three."""
    metrics_port = _free_port()
    args = ("--num-kv-blocks", "26", "--block-size", "8", "--metrics-port", str(metrics_port))
    with running_pair(demo_model_dir, *args) as pair:
        yield (*pair, f"http://127.0.0.1:{metrics_port}/metrics")


async def test_outputs_survive_preemption_by_recompute(tight, stub):
    params = dict(max_tokens=80, temperature=0.0, **CONSTRAINTS["json_schema"])
    reference = await asyncio.gather(*(generate(stub, text=p, params=params) for p in PROMPTS[:3]))
    async with grpc.aio.insecure_channel(tight[1].address) as channel:
        tight_stub = stub_of(channel)
        results = await asyncio.gather(*(generate(tight_stub, text=p, params=params) for p in PROMPTS[:3]))
    assert _metrics(tight[2])[("tandem_engine_preemptions_total", ())] > 0
    assert [text_of(r) for r in results] == [text_of(r) for r in reference]
    finished = [text_of(r) for r in results if r[-1].finish_reason == g.FINISH_REASON_STOP]
    assert finished and all(VALID["json_schema"](t) for t in finished), finished


async def test_a_compile_past_the_timeout_fails_in_band_and_its_batch_goes_on(demo_model_dir):
    # The compile starts at once (the threads are idle) and runs for ~0.5 s on an idle
    # core: its own cost, not a queue, passes the limit.
    engine = start_engine(demo_model_dir, "--num-kv-blocks", "64", "--structured-output-timeout-s", "0.1")
    props = {f"f{k}": {"type": "string", "format": "email"} for k in range(1000)}
    schema = json.dumps({"type": "object", "properties": props, "required": list(props)})
    try:
        engine.wait_serving()
        async with grpc.aio.insecure_channel(engine.address) as channel:
            stream = EngineStream(channel)
            slow = stream.add("slow", [5, 6, 7], max_tokens=4, json_schema=schema)
            free = stream.add("free", [5, 6, 7], max_tokens=4, temperature=0.0, ignore_eos=True)
            await stream.wait("slow", "free")
            stream.close()
            await stream.finished()
    finally:
        engine.terminate()
    assert slow.error.code == engine_pb2.ERROR_CODE_INVALID_ARGUMENT and slow.token_ids == []
    assert slow.error.message.startswith(
        "sampling_params.json_schema: compiling it took longer than this engine's limit"
    ), slow.error.message
    assert "--structured-output-timeout-s" in slow.error.message and slow.error.field == "sampling_params.json_schema"
    assert free.error is None and len(free.token_ids) == 4


def test_grpcurl_sends_a_constraint_and_refuses_two(services):
    """The real grpcurl, through reflection: the documented JSON spellings work. Two
    members of the constraint oneof cannot both arrive: grpcurl, like binary protobuf,
    keeps the last one (Python's json_format refuses the request instead)."""
    address = services[1].address
    method = "tandem.generate.v1.GenerateService/Generate"
    request = {
        "text": "Colour:",
        "sampling_params": {"choice": {"choices": list(CHOICES)}, "temperature": 0},
    }
    out = grpcurl("-plaintext", "-max-time", "60", "-d", json.dumps(request), address, method)
    pieces = json_objects(out)
    assert "".join(p.get("text", "") for p in pieces) in CHOICES
    assert pieces[-1]["finish_reason"] == "FINISH_REASON_STOP"

    grammar = {"syntax": "GRAMMAR_SYNTAX_LARK", "text": ARITHMETIC}
    request = {"text": "Sum:", "sampling_params": {"max_tokens": 40, "temperature": 0, "grammar": grammar}}
    pieces = json_objects(grpcurl("-plaintext", "-max-time", "60", "-d", json.dumps(request), address, method))
    if pieces[-1]["finish_reason"] == "FINISH_REASON_STOP":
        assert VALID["grammar"]("".join(p.get("text", "") for p in pieces))

    both = {"text": "hi", "sampling_params": {"max_tokens": 4, "regex": "[a-z]+", "json_object": True}}
    pieces = json_objects(grpcurl("-plaintext", "-max-time", "60", "-d", json.dumps(both), address, method))
    assert "".join(p.get("text", "") for p in pieces).startswith("{")
    with pytest.raises(json_format.ParseError, match='multiple "constraint" oneof fields'):
        json_format.Parse(json.dumps(both["sampling_params"]), g.SamplingParams())
