"""Speculative decoding through a real pair: the public API's text is the same with
drafts on and off, for stop strings and n > 1, and the engine's metrics count the drafts.

The model is random (small init, so greedy output falls into loops that prompt lookup
predicts) with the demo model's tokenizer files beside it, so the frontend can serve it.
Both engines run float32; the one with speculation also serves metrics.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import urllib.request

import grpc
import pytest

from engine_svc.demo_model import VOCAB_SIZE
from tests.model_factory import make_model_dir
from tests.rpc.frontend_calls import by_choice, generate, stub_of, text_of
from tests.services import running_pair

SPEC = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, '
    '"adaptive": false}'
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def loop_model(tmp_path_factory, demo_model_dir):
    path = make_model_dir(
        tmp_path_factory.mktemp("spec-rpc") / "loop", vocab_size=VOCAB_SIZE, initializer_range=0.02, seed=3
    )
    for name in TOKENIZER_FILES:
        shutil.copy(demo_model_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def pairs(loop_model):
    metrics_port = free_port()
    common = ("--dtype", "float32", "--num-kv-blocks", "256")
    with running_pair(loop_model, *common) as off:
        with running_pair(loop_model, *common, "--speculative-config", SPEC, "--metrics-port", str(metrics_port)) as on:
            yield off[1], on[1], f"http://127.0.0.1:{metrics_port}/metrics"


async def texts(frontend, **kw) -> dict[int, tuple[str, str, list[int]]]:
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        responses = await generate(stub_of(channel), **kw)
    return {
        i: (text_of(rs), rs[-1].finish_reason, [t for r in rs for t in r.token_ids])
        for i, rs in by_choice(responses).items()
    }


def test_text_stop_strings_and_n_identical(pairs):
    off, on, metrics_url = pairs
    probe = asyncio.run(texts(off, text="the cat sat on", params=dict(max_tokens=64, temperature=0.0, ignore_eos=True)))
    text = probe[0][0]
    assert len(text) > 40
    stop = text[30:34]  # a stop string the output reaches mid-way, perhaps inside a draft
    cases = [
        dict(text="the cat sat on", params=dict(max_tokens=64, temperature=0.0, ignore_eos=True, stop=[stop])),
        dict(text="the cat sat on", params=dict(max_tokens=64, temperature=0.0, ignore_eos=True, n=2)),
        dict(text="once upon", params=dict(max_tokens=40, temperature=0.8, seed=7, n=3, ignore_eos=True)),
    ]
    for case in cases:
        want = asyncio.run(texts(off, **case))
        got = asyncio.run(texts(on, **case))
        assert got == want, case
    assert asyncio.run(texts(on, **cases[0]))[0][0] == text[: text.index(stop)]

    with urllib.request.urlopen(metrics_url, timeout=5) as page:
        metrics = page.read().decode()
    values = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("tandem_engine_spec_decode") and not line.startswith("#")
    }
    assert values["tandem_engine_spec_decode_num_accepted_tokens_total"] > 0
    assert (
        values["tandem_engine_spec_decode_num_draft_tokens_total"]
        >= values["tandem_engine_spec_decode_num_accepted_tokens_total"]
    )
    assert values["tandem_engine_spec_decode_mean_accepted_length"] > 1.0
