"""The engine service through a real gRPC server on 127.0.0.1 and a real client."""

from __future__ import annotations

import asyncio
import json
import random

import grpc
import pytest

from tandem_protos.tandem.engine.v1 import engine_pb2 as pb
from tandem_protos.tandem.engine.v1 import engine_pb2_grpc
from tests.grpcurl import grpcurl
from tests.rpc.engine_stream import EngineStream, wait_idle
from tests.services import start_engine


@pytest.fixture
async def channel(engine_proc):
    async with grpc.aio.insecure_channel(engine_proc.address) as ch:
        yield ch


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


async def test_hundred_requests_on_one_stream(channel):
    rng = random.Random(0)
    stream = EngineStream(channel)
    lengths = {f"r{i}": rng.randint(1, 12) for i in range(100)}
    for rid, n in lengths.items():
        stream.add(rid, _prompt(rng, rng.randint(1, 40)), max_tokens=n, ignore_eos=True, temperature=0.0)
    await stream.wait(*lengths, timeout=120)
    for rid, n in lengths.items():
        r = stream.results[rid]
        assert len(r.token_ids) == n, rid
        assert r.finish_reason == pb.FINISH_REASON_LENGTH
    stream.close()
    await stream.finished()
    await wait_idle(engine_pb2_grpc.EngineServiceStub(channel))


async def test_three_streams_get_only_their_own_outputs(channel):
    rng = random.Random(1)
    streams = [EngineStream(channel) for _ in range(3)]
    ids = {}
    for s_index, stream in enumerate(streams):
        # The same request ids on every stream: ids are unique per stream only.
        ids[s_index] = [f"req-{i}" for i in range(5)]
        for i, rid in enumerate(ids[s_index]):
            stream.add(rid, _prompt(rng, 8), max_tokens=3 + s_index + i, ignore_eos=True, temperature=0.0)
    for s_index, stream in enumerate(streams):
        await stream.wait(*ids[s_index])
        assert not stream.foreign_ids
        for i, rid in enumerate(ids[s_index]):
            assert len(stream.results[rid].token_ids) == 3 + s_index + i
        stream.close()
        await stream.finished()


async def test_aborts_free_everything(channel):
    stub = engine_pb2_grpc.EngineServiceStub(channel)
    rng = random.Random(2)
    stream = EngineStream(channel)
    keep = stream.add("keep", _prompt(rng, 16), max_tokens=40, ignore_eos=True, temperature=0.0)
    mid = stream.add("mid", _prompt(rng, 16), max_tokens=2000, ignore_eos=True)
    await asyncio.wait_for(mid.first_output.wait(), 30)  # decoding now, whatever the machine's speed
    stream.abort("mid")
    stream.abort("mid")  # twice: a no-op
    stream.abort("never-added")  # unknown: a no-op
    await stream.wait("mid")
    assert stream.results["mid"].finish_reason == pb.FINISH_REASON_ABORT
    # Abort right after add: it may be caught while waiting.
    stream.add("waiting", _prompt(rng, 300), max_tokens=5)
    stream.abort("waiting")
    await stream.wait("waiting", "keep")
    assert stream.results["waiting"].finish_reason == pb.FINISH_REASON_ABORT
    assert len(keep.token_ids) == 40 and keep.finish_reason == pb.FINISH_REASON_LENGTH
    stream.close()
    await stream.finished()
    await wait_idle(stub)


async def test_cancelled_stream_aborts_its_requests(channel):
    stub = engine_pb2_grpc.EngineServiceStub(channel)
    stream = EngineStream(channel)
    for i in range(8):
        stream.add(f"r{i}", list(range(5, 60)), max_tokens=5000, ignore_eos=True)
    # The load is a snapshot taken after each engine step: wait for one that shows them.
    deadline = asyncio.get_running_loop().time() + 30
    while (await stub.GetLoad(pb.GetLoadRequest())).load.num_used_blocks == 0:
        assert asyncio.get_running_loop().time() < deadline, "the requests never held KV blocks"
        await asyncio.sleep(0.05)
    stream.cancel()
    await wait_idle(stub)


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ([], {}, "prompt_token_ids"),
        ([1, 2, 10**6], {}, "prompt_token_ids"),
        ([1] * 5000, {}, "prompt_token_ids"),
        ([1, 2], {"temperature": -1.0}, "sampling_params.temperature"),
        ([1, 2], {"top_p": 0.0}, "sampling_params.top_p"),
        ([1, 2], {"top_k": -5}, "sampling_params.top_k"),
        ([1, 2], {"min_p": 1.5}, "sampling_params.min_p"),
        ([1, 2], {"presence_penalty": 3.0}, "sampling_params.presence_penalty"),
        ([1, 2], {"repetition_penalty": 0.0}, "sampling_params.repetition_penalty"),
        ([1, 2], {"max_tokens": 0}, "sampling_params.max_tokens"),
        ([1, 2], {"logprobs": 100}, "sampling_params.logprobs"),
        ([1, 2], {"stop_token_ids": [10**6]}, "sampling_params.stop_token_ids"),
    ],
)
async def test_invalid_requests_get_in_band_errors(channel, prompt, params, field):
    stream = EngineStream(channel)
    stream.add("ok-before", [5, 6, 7], max_tokens=4, ignore_eos=True)
    stream.add("bad", prompt, **params)
    stream.add("ok-after", [5, 6, 7], max_tokens=4, ignore_eos=True)
    await stream.wait("bad", "ok-before", "ok-after")
    bad = stream.results["bad"]
    assert bad.finish_reason == pb.FINISH_REASON_ERROR
    assert bad.error.code == pb.ERROR_CODE_INVALID_ARGUMENT
    assert bad.error.field == field and bad.error.message
    for rid in ("ok-before", "ok-after"):
        assert len(stream.results[rid].token_ids) == 4
    stream.close()
    await stream.finished()


async def test_duplicate_request_id_is_refused_in_band(channel):
    stream = EngineStream(channel)
    first = stream.add("dup", [5, 6, 7], max_tokens=1000, ignore_eos=True)
    # In flight for sure (an output came and it cannot finish on its own for a long time),
    # whatever the machine's speed: no sleep to race.
    await asyncio.wait_for(first.first_output.wait(), 30)
    stream.add("dup", [5, 6, 7], max_tokens=30, ignore_eos=True)
    await asyncio.wait_for(stream.got_rejection.wait(), 30)
    (rejected,) = stream.rejected
    assert rejected.request_id == "dup" and rejected.error.code == pb.ERROR_CODE_INVALID_ARGUMENT
    assert rejected.error.field == "request_id" and "already in flight" in rejected.error.message
    # The refusal did not finish the live request: it runs until aborted, and ends once.
    assert not first.done.is_set()
    stream.abort("dup")
    await stream.wait("dup")
    assert first.finish_reason == pb.FINISH_REASON_ABORT and first.num_finishes == 1 and first.error is None
    stream.close()
    await stream.finished()


async def test_unary_rpcs(channel, demo_model_dir):
    import hashlib

    stub = engine_pb2_grpc.EngineServiceStub(channel)
    info = await stub.GetModelInfo(pb.GetModelInfoRequest())
    config = json.loads((demo_model_dir / "config.json").read_text())
    assert info.vocab_size == config["vocab_size"]
    assert info.max_model_len == config["max_position_embeddings"]
    assert info.kv_capacity_tokens == info.num_kv_blocks * info.block_size == 512 * 16
    assert list(info.eos_token_ids) and info.architecture == "LlamaForCausalLM"
    files: dict[str, bytearray] = {}
    digests = {}
    async for chunk in stub.GetTokenizer(pb.GetTokenizerRequest()):
        files.setdefault(chunk.file_name, bytearray()).extend(chunk.data)
        digests[chunk.file_name] = chunk.sha256
    assert "tokenizer.json" in files
    for name, data in files.items():
        assert hashlib.sha256(data).hexdigest() == digests[name]
        assert bytes(data) == (demo_model_dir / name).read_bytes()
    load = (await stub.GetLoad(pb.GetLoadRequest())).load
    assert load.num_running == 0 and not load.draining


def test_sigterm_drains(demo_model_dir):
    async def scenario():
        engine = start_engine(demo_model_dir, "--num-kv-blocks", "256", "--shutdown-timeout", "120")
        try:
            engine.wait_serving()
            async with grpc.aio.insecure_channel(engine.address) as ch:
                stub = engine_pb2_grpc.EngineServiceStub(ch)
                stream = EngineStream(ch)
                inflight = stream.add("inflight", [5, 6, 7, 8], max_tokens=120, ignore_eos=True)
                # No sleeps to race: running for sure before the signal, draining for sure
                # (the engine applied it) before the late add.
                await asyncio.wait_for(inflight.first_output.wait(), 30)
                engine.proc.send_signal(15)
                deadline = asyncio.get_running_loop().time() + 30
                while not (await stub.GetLoad(pb.GetLoadRequest())).load.draining:
                    assert asyncio.get_running_loop().time() < deadline, "the engine never started draining"
                    await asyncio.sleep(0.02)
                late = stream.add("late", [5, 6, 7], max_tokens=5)
                await stream.wait("inflight", "late", timeout=120)
                assert len(inflight.token_ids) == 120
                assert late.finish_reason == pb.FINISH_REASON_ERROR
                assert late.error.code == pb.ERROR_CODE_UNAVAILABLE
            assert engine.proc.wait(30) == 0
        finally:
            engine.terminate()

    asyncio.run(scenario())


def test_grpcurl_drives_the_stream(engine_proc):
    body = "\n".join(
        json.dumps(m)
        for m in [
            {
                "add": {
                    "requestId": "a",
                    "promptTokenIds": [5, 6, 7],
                    "samplingParams": {"maxTokens": 3, "ignoreEos": True},
                }
            },
            {
                "add": {
                    "requestId": "b",
                    "promptTokenIds": [5, 6, 7],
                    "samplingParams": {"maxTokens": 4000, "ignoreEos": True},
                }
            },
            {"abort": {"requestIds": ["b"]}},
        ]
    )
    out = grpcurl("-plaintext", "-d", "@", engine_proc.address, "tandem.engine.v1.EngineService/Stream", stdin=body)
    messages = [json.loads(m) for m in _split_json_stream(out)]
    outputs = [o for m in messages for o in m.get("outputs", [])]
    # grpcurl prints proto field names.
    finishes = {o["request_id"]: o["finish_reason"] for o in outputs if "finish_reason" in o}
    assert finishes == {"a": "FINISH_REASON_LENGTH", "b": "FINISH_REASON_ABORT"}
    assert sum(len(o.get("new_token_ids", [])) for o in outputs if o["request_id"] == "a") == 3
    info = json.loads(grpcurl("-plaintext", engine_proc.address, "tandem.engine.v1.EngineService/GetModelInfo"))
    assert info["architecture"] == "LlamaForCausalLM"
    load = json.loads(grpcurl("-plaintext", engine_proc.address, "tandem.engine.v1.EngineService/GetLoad"))
    assert "load" in load


def _split_json_stream(text: str) -> list[str]:
    decoder, pos, items = json.JSONDecoder(), 0, []
    text = text.strip()
    while pos < len(text):
        obj, end = decoder.raw_decode(text, pos)
        items.append(json.dumps(obj))
        pos = end
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return items


async def test_an_oversized_request_id_ends_only_its_stream(channel):
    """Ids are echoed in every output, whose size is bounded: a 2 KB id is a malformed message."""
    stub = engine_pb2_grpc.EngineServiceStub(channel)
    bad = EngineStream(channel)
    bad.add("x" * 2000, [5, 6, 7], max_tokens=2)
    assert await bad.status(timeout=30) == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id is 2000 bytes; at most 1024" in await bad.call.details()
    good = EngineStream(channel)
    good.add("fine", [5, 6, 7], max_tokens=2, ignore_eos=True)
    await good.wait("fine")
    good.close()
    await good.finished()
    await wait_idle(stub)
