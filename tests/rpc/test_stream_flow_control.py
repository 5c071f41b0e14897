"""Flow control on the engine stream (issue 18, item 5), through a real engine on 127.0.0.1.

A reader that stops reading must neither make the engine buffer without bound nor get
one giant message when it reads again: the engine pauses that stream's requests once
--stream-backlog-bytes of output wait unsent, resumes them when the reader catches up,
and hands the backlog out in messages under a quarter of --max-message-bytes. Other
streams go on meanwhile. A client may also pause single requests (its own caller does not
read them): they wait alone, and resume where they were.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem_protos.tandem.engine.v1 import engine_pb2 as pb
from tandem_protos.tandem.engine.v1 import engine_pb2_grpc
from tests.rpc.engine_stream import EngineStream, wait_idle
from tests.services import start_engine

MAX_MESSAGE_BYTES = 256 * 1024
BACKLOG_BYTES = 256 * 1024
NUM_REQUESTS, PROMPT_LEN = 4, 600
# Without BDP probing the client's HTTP/2 window stays small, so a reader that does not
# read holds back the engine's writes soon instead of buffering megabytes.
CLIENT_OPTIONS = [("grpc.http2.bdp_probe", 0)]


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    proc = start_engine(
        demo_model_dir,
        "--num-kv-blocks",
        "512",
        "--max-message-bytes",
        str(MAX_MESSAGE_BYTES),
        "--stream-backlog-bytes",
        str(BACKLOG_BYTES),
    )
    try:
        yield proc.wait_serving()
    finally:
        proc.terminate()


async def _poll_load(stub, until, timeout: float) -> pb.EngineLoad:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        load = (await stub.GetLoad(pb.GetLoadRequest())).load
        if until(load):
            return load
        assert asyncio.get_running_loop().time() < deadline, f"load never matched: {load}"
        await asyncio.sleep(0.05)


async def test_a_reader_that_stops_reading_pauses_its_stream_only(engine):
    async with (
        grpc.aio.insecure_channel(engine.address, options=CLIENT_OPTIONS) as lagging_channel,
        grpc.aio.insecure_channel(engine.address) as channel,
    ):
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        outbox: asyncio.Queue = asyncio.Queue()

        async def control():
            while (msg := await outbox.get()) is not None:
                yield msg

        call = engine_pb2_grpc.EngineServiceStub(lagging_channel).Stream(control())
        # ~250 bytes of prompt logprobs per prompt token: megabytes of output in a few steps.
        for i in range(NUM_REQUESTS):
            prompt = [(i * 31 + j) % 2000 + 3 for j in range(PROMPT_LEN)]
            params = pb.SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=20, temperature=0.0)
            outbox.put_nowait(
                pb.StreamRequest(add=pb.Add(request_id=f"big{i}", prompt_token_ids=prompt, sampling_params=params))
            )
        outbox.put_nowait(None)

        # Nobody reads `call`: the engine pauses its requests instead of buffering on.
        paused = await _poll_load(stub, lambda load: load.num_paused > 0, timeout=60)
        assert paused.num_running == paused.num_waiting == 0  # every live request of the stream

        # Another stream is not held up by the paused one.
        other = EngineStream(channel)
        other.add("other", [5, 6, 7], max_tokens=8, ignore_eos=True)
        await other.wait("other", timeout=30)
        assert len(other.results["other"].token_ids) == 8
        other.close()
        await other.finished()
        assert (await stub.GetLoad(pb.GetLoadRequest())).load.num_paused > 0, "resumed with nobody reading"

        # Reading again: everything arrives, in bounded messages, each request once.
        prompt_logprobs = {f"big{i}": 0 for i in range(NUM_REQUESTS)}
        finishes = {rid: 0 for rid in prompt_logprobs}
        sizes = []
        async for response in call:
            sizes.append(response.ByteSize())
            for out in response.outputs:
                prompt_logprobs[out.request_id] += len(out.prompt_logprobs)
                finishes[out.request_id] += bool(out.finish_reason)
        assert await call.code() == grpc.StatusCode.OK
        assert max(sizes) <= MAX_MESSAGE_BYTES // 4, max(sizes)
        assert prompt_logprobs == {rid: PROMPT_LEN - 1 for rid in prompt_logprobs}
        assert finishes == {rid: 1 for rid in finishes}
        await wait_idle(stub)
        assert (await stub.GetLoad(pb.GetLoadRequest())).load.num_paused == 0


async def test_a_paused_request_waits_alone_and_resumes_where_it_was(engine):
    async with grpc.aio.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        stream = EngineStream(channel)
        held = stream.add("held", [11, 12, 13, 14, 15], max_tokens=120, ignore_eos=True)
        await held.first_output.wait()
        stream.pause("held", "unknown")  # an id the stream never added is ignored
        await _poll_load(stub, lambda load: load.num_paused == 1, timeout=30)
        num_before = len(held.token_ids)
        other = stream.add("other", [5, 6, 7], max_tokens=40, ignore_eos=True)
        await stream.wait("other", timeout=30)  # the stream's other requests go on
        assert len(other.token_ids) == 40
        assert len(held.token_ids) == num_before < 120 and not held.done.is_set()
        paused = (await stub.GetLoad(pb.GetLoadRequest())).load
        assert (paused.num_paused, paused.num_running, paused.num_used_blocks) == (1, 0, 0)  # no KV blocks held

        stream.resume("held")
        await stream.wait("held", timeout=30)
        # From where it was: the tokens before the pause count towards max_tokens; it ends once.
        assert len(held.token_ids) == 120 and held.num_finishes == 1
        stream.close()
        await stream.finished()
        assert (await wait_idle(stub)).num_paused == 0
