"""Limits: messages over the size limit, a huge prompt within it, and a flood beyond the
engine's waiting queue. Each must be refused cleanly (RESOURCE_EXHAUSTED or
INVALID_ARGUMENT) while the services keep serving everyone else, with bounded memory."""

from __future__ import annotations

import asyncio
import collections
import shutil
import time
from pathlib import Path

import grpc
import pytest

from tandem_protos.tandem.engine.v1 import engine_pb2 as pb
from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tests.reliability.faults import (
    ENGINE_SERVICE,
    SERVING,
    CallRecord,
    read_call,
    request,
    wait_engine_drained,
    wait_health,
)
from tests.rpc.engine_stream import EngineStream
from tests.rpc.frontend_calls import generate, stub_of
from tests.services import start_engine, start_frontend

LIMIT = 1024 * 1024  # --max-message-bytes of the `limited` pair
BIG_CLIENT = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def limited(demo_model_dir, tmp_path_factory):
    """An engine and a frontend with 1 MiB message limits and a short waiting queue. The
    model's tokenizer.json is padded past the limit, as real ones (7-11 MB) are."""
    model = tmp_path_factory.mktemp("big-tokenizer") / "demo-model"
    model.mkdir()
    for f in demo_model_dir.iterdir():
        if f.name == "model.safetensors":
            (model / f.name).symlink_to(f)
        else:
            shutil.copy(f, model / f.name)
    with (model / "tokenizer.json").open("a") as f:
        f.write(" " * (LIMIT + 300_000))  # JSON allows trailing whitespace
    engine = start_engine(
        model, "--num-kv-blocks", "128", "--max-num-seqs", "2", "--max-waiting", "2", "--max-message-bytes", str(LIMIT)
    )
    frontend = None
    try:
        engine.wait_serving()
        frontend = start_frontend(engine.address, extra=("--max-message-bytes", str(LIMIT)))
        # SERVING means the frontend fetched the 1.3 MB tokenizer.json in chunks under the limit.
        yield engine, frontend.wait_serving(timeout=60)
    finally:
        if frontend is not None:
            frontend.terminate()
        engine.terminate()


async def test_messages_over_the_size_limit_are_resource_exhausted(limited):
    engine, frontend = limited
    over = "x" * (LIMIT + 1024)
    async with grpc.aio.insecure_channel(frontend.address, options=BIG_CLIENT) as channel:
        stub = stub_of(channel)
        calls = [
            ("Received", lambda: generate(stub, text=over)),
            ("Received", lambda: stub.Tokenize(g.TokenizeRequest(text=over))),
            ("Received", lambda: stub.Detokenize(g.DetokenizeRequest(token_ids=[2000] * (LIMIT // 2)))),
            # A request under the limit whose answer is over it (id 2000 is " building").
            ("Sent", lambda: stub.Detokenize(g.DetokenizeRequest(token_ids=[2000] * (LIMIT // 4)))),
        ]
        for direction, call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await call()
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.value.details()
            assert f"{direction} message larger than max" in error.value.details()
        responses = await generate(stub, text="small", params=dict(max_tokens=2, ignore_eos=True))
        assert responses[-1].usage.completion_tokens == 2

    # The engine's stream: the oversized control message fails that stream only.
    async with grpc.aio.insecure_channel(engine.address, options=BIG_CLIENT) as channel:
        stream = EngineStream(channel)
        stream.add("big", [2000] * (LIMIT // 2))  # two bytes per id on the wire
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stream.finished(timeout=30)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await wait_engine_drained(engine.address)
    await wait_health(engine, SERVING, timeout=5, service=ENGINE_SERVICE)
    await wait_health(frontend, SERVING, timeout=5)


async def test_a_huge_prompt_is_refused_before_it_is_tokenized(shared):
    """Prompts that cannot fit the 2048-token context are refused from their length alone:
    text (no token of the demo model stands for more than 17 characters), chat messages
    (their rendered text), token ids (before a single id is looked at). Tokenizing 1.6 MB of
    text took seconds and ~100 bytes of frontend memory per character; now five such calls
    at once barely grow the frontend, and other calls go on meanwhile."""
    engine, frontend = shared
    rss_before = rss_mib(frontend.proc.pid)
    text = "a b " * 400_000
    async with grpc.aio.insecure_channel(frontend.address, options=BIG_CLIENT) as channel:
        stub = stub_of(channel)
        huge = [asyncio.create_task(generate(stub, text=text, timeout=120)) for _ in range(3)]
        huge.append(asyncio.ensure_future(stub.Tokenize(g.TokenizeRequest(text=text), timeout=120)))
        chat = g.ChatMessages(messages=[g.ChatMessage(role="user", content=text)])
        huge.append(asyncio.create_task(generate(stub, messages=chat, timeout=120)))
        latencies = []
        while not all(t.done() for t in huge) and len(latencies) < 20:
            t0 = time.monotonic()
            await stub.Tokenize(g.TokenizeRequest(text="hello"), timeout=30)
            latencies.append(time.monotonic() - t0)
            await asyncio.sleep(0.05)
        for task, field in zip(huge, ["text"] * 4 + ["messages"]):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await task
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            details = error.value.details()
            assert details.startswith(f"{field}: the text has ") and "at most 34799 characters can fit" in details
        # 4 M token ids, the last one outside the vocabulary: the length alone refuses them.
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await generate(stub, token_ids=[5] * 4_000_000 + [10**7], timeout=120)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details().startswith("token_ids.ids: the prompt has 4000001 tokens but the model's context")
    assert max(latencies, default=0.0) < 1.0, latencies
    assert rss_mib(frontend.proc.pid) - rss_before < 100


async def test_a_flood_beyond_the_waiting_queue_is_resource_exhausted(limited):
    engine, frontend = limited
    rss_before = rss_mib(engine.proc.pid), rss_mib(frontend.proc.pid)
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        stub = stub_of(channel)
        records = [CallRecord(max_tokens=24) for _ in range(60)]
        await asyncio.wait_for(
            asyncio.gather(
                *(read_call(stub.Generate(request(f"flood {i}", max_tokens=24)), r) for i, r in enumerate(records))
            ),
            120,
        )
        codes = collections.Counter(r.code.name for r in records)
        assert set(codes) == {"OK", "RESOURCE_EXHAUSTED"} and codes["OK"] >= 2, codes
        for r in records:
            r.check_complete_or_explained(grpc.StatusCode.RESOURCE_EXHAUSTED)
            if r.code != grpc.StatusCode.OK:
                assert "waiting queue is full (2 requests)" in r.details, r

    # Straight at the engine: 3000 adds on one stream; the engine refuses what it cannot queue.
    async with grpc.aio.insecure_channel(engine.address) as channel:
        stream = EngineStream(channel)
        ids = [f"r{i}" for i in range(3000)]
        for rid in ids:
            stream.add(rid, [5, 6, 7, 8], max_tokens=4, ignore_eos=True)
        await stream.wait(*ids, timeout=120)
        refused = [r for r in stream.results.values() if r.error is not None]
        assert refused and all(r.error.code == pb.ERROR_CODE_RESOURCE_EXHAUSTED for r in refused)
        assert all(len(r.token_ids) == 4 for r in stream.results.values() if r.error is None)
        stream.close()
        await stream.finished()
    await wait_engine_drained(engine.address)
    await wait_health(engine, SERVING, timeout=5, service=ENGINE_SERVICE)
    await wait_health(frontend, SERVING, timeout=5)
    growth = rss_mib(engine.proc.pid) - rss_before[0], rss_mib(frontend.proc.pid) - rss_before[1]
    assert max(growth) < 300, f"RSS grew by {growth} MiB"
