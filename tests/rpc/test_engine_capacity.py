"""The KV pool, through real engines (issue 18, items 12 and 14).

* A request that can never fit the pool (prompt + max_tokens beyond it) is refused up
  front, naming the largest max_tokens that fits, instead of streaming part of its
  output and then failing.
* Without --num-kv-blocks / --kv-cache-bytes the pool is sized from the model and the
  scheduler (max_num_seqs requests of max_model_len), not a fixed gigabyte, and a
  --max-model-len beyond the model's positions is lowered with a warning.
"""

from __future__ import annotations

import grpc
import pytest

from tandem_protos.tandem.engine.v1 import engine_pb2 as pb
from tandem_protos.tandem.engine.v1 import engine_pb2_grpc
from tests.rpc.engine_stream import EngineStream
from tests.services import start_engine

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def small_pool(demo_model_dir):
    proc = start_engine(demo_model_dir, "--num-kv-blocks", "8")  # 128 tokens in all
    try:
        yield proc.wait_serving()
    finally:
        proc.terminate()


async def test_a_request_that_can_never_fit_is_refused_before_any_token(small_pool):
    async with grpc.aio.insecure_channel(small_pool.address) as channel:
        stream = EngineStream(channel)
        prompt = list(range(5, 25))  # 20 tokens: 108 more fit
        too_long = stream.add("too-long", prompt, max_tokens=200, ignore_eos=True)
        fits = stream.add("fits", prompt, max_tokens=108, ignore_eos=True)
        huge_prompt = stream.add("huge-prompt", list(range(5, 205)), max_tokens=1)
        await stream.wait("too-long", "fits", "huge-prompt")
        assert too_long.token_ids == [] and too_long.num_messages == 1  # nothing streamed first
        assert too_long.error.code == pb.ERROR_CODE_INVALID_ARGUMENT
        assert too_long.error.field == "sampling_params.max_tokens"
        assert "set max_tokens to at most 108" in too_long.error.message
        assert huge_prompt.error.field == "prompt_token_ids" and "holds 128 tokens" in huge_prompt.error.message
        assert len(fits.token_ids) == 108 and fits.finish_reason == pb.FINISH_REASON_LENGTH
        stream.close()
        await stream.finished()


def test_the_default_pool_is_sized_from_the_model(demo_model_dir):
    # float32 pins the block size in bytes: "auto" picks bfloat16 on CPUs with AVX512-BF16.
    engine = start_engine(demo_model_dir, "--max-num-seqs", "4", "--max-model-len", "100000", "--dtype", "float32")
    try:
        engine.wait_serving()
        with grpc.insecure_channel(engine.address) as channel:
            info = engine_pb2_grpc.EngineServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert info.max_model_len == 2048  # the demo model's positions
        # 4 requests of 2048 tokens: 512 blocks of 16 (it used to be 1 GiB: 16384 blocks).
        assert info.num_kv_blocks == 4 * 2048 // BLOCK_SIZE
        log = engine.log()
        assert "--max-model-len 100000 is beyond the model's max_position_embeddings; using 2048" in log
        assert "KV cache: 512 blocks (32.0 MiB), enough for 4 requests (--max-num-seqs) of max_model_len 2048" in log
    finally:
        engine.terminate()
