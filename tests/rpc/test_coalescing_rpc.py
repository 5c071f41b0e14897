"""Coalescing end to end: the same requests on the demo model stream the same text, token
ids, logprobs, finish reasons and usage with adaptive coalescing (the default), one message
per token (--stream-interval 1) and a fixed interval (--stream-interval 3)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tests.rpc.frontend_calls import by_choice, generate, stub_of, text_of
from tests.services import start_engine, start_frontend

PROMPTS = ["The capital of France is", "Once upon a time", "def main():"]
SETTINGS = {"adaptive": (), "one per token": ("--stream-interval", "1"), "every 3": ("--stream-interval", "3")}


@pytest.fixture(scope="module")
def frontends(demo_model_dir):
    # float32: each row's result then never depends on what else is in its step (bfloat16
    # goes to oneDNN on AMX CPUs, whose GEMM blocks by the batch's rows), and the three
    # frontends' requests share the engine's steps in whatever mix they arrive.
    engine = start_engine(demo_model_dir, "--num-kv-blocks", "512", "--dtype", "float32")
    started = []
    try:
        engine.wait_serving()
        started = [start_frontend(engine.address, extra=extra) for extra in SETTINGS.values()]
        yield {name: f.wait_serving().address for name, f in zip(SETTINGS, started, strict=True)}
    finally:
        for f in started:
            f.terminate()
        engine.terminate()


def _requests(stop: str) -> list[dict]:
    """Greedy or seeded requests with stop strings (held back), n > 1 and logprobs."""
    greedy = dict(temperature=0.0, ignore_eos=True)
    seeded = dict(temperature=1.0, seed=11, ignore_eos=True)
    return [dict(text=p, params=dict(max_tokens=24, logprobs=2, **greedy)) for p in PROMPTS] + [
        dict(text=PROMPTS[0], params=dict(max_tokens=24, stop=[stop], **greedy)),
        dict(text=PROMPTS[0], params=dict(max_tokens=24, stop=[stop], include_stop_str_in_output=True, **greedy)),
        dict(text=PROMPTS[1], params=dict(n=3, max_tokens=16, logprobs=1, prompt_logprobs=1, **seeded)),
        dict(text=PROMPTS[2], params=dict(n=2, max_tokens=16, stop=[" ", "e"], min_tokens=3, **seeded)),
    ]


def _summary(responses: list[g.GenerateResponse]) -> dict:
    """Per choice: everything a client sees, concatenated over the messages."""
    out = {}
    for index, rs in by_choice(responses).items():
        last = rs[-1]
        out[index] = dict(
            text=text_of(rs),
            token_ids=[t for r in rs for t in r.token_ids],
            logprobs=[
                (lp.token_id, lp.token, lp.logprob, lp.rank, [(t.token_id, t.logprob) for t in lp.top])
                for r in rs
                for lp in r.logprobs
            ],
            prompt_logprobs=[(lp.token_id, lp.token, lp.logprob) for r in rs for lp in r.prompt_logprobs],
            finish=(last.finish_reason, last.WhichOneof("matched_stop"), last.stop_str, last.stop_token_id),
            usage=(last.usage.prompt_tokens, last.usage.completion_tokens),
            ends=sum(1 for r in rs if r.finish_reason != g.FINISH_REASON_UNSPECIFIED),
        )
    return out


async def _run(address: str, requests: list[dict], repeat: int):
    """Every request ``repeat`` times, all at once (a loaded frontend coalesces)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = stub_of(channel)
        calls = [generate(stub, text=r["text"], params=r["params"]) for r in requests for _ in range(repeat)]
        return await asyncio.gather(*calls)


async def test_every_setting_streams_the_same_choices(frontends):
    async with grpc.aio.insecure_channel(frontends["one per token"]) as channel:
        base = text_of(
            await generate(
                stub_of(channel), text=PROMPTS[0], params=dict(max_tokens=24, temperature=0.0, ignore_eos=True)
            )
        )
    stop = base[8:12]
    if len(stop) < 3:
        pytest.skip(f"the demo model wrote too little text: {base!r}")
    requests = _requests(stop)
    runs = {name: await _run(address, requests, repeat=2) for name, address in frontends.items()}
    expected = [_summary(r) for r in runs["one per token"]]
    assert any(s[0]["finish"][1] == "stop_str" for s in expected)  # the stop strings did hit
    for name, responses in runs.items():
        assert [_summary(r) for r in responses] == expected, name
    # One message per token exactly with --stream-interval 1; several per message with 3.
    sizes = {name: [len(m.token_ids) for r in responses for m in r if m.token_ids] for name, responses in runs.items()}
    assert set(sizes["one per token"]) == {1}
    assert max(sizes["every 3"]) >= 3
