"""OpenAI wire details as clients and test harnesses check them: a chat stream's last chunk
has ``"delta": {}``; the running usage comes only with ``include_usage``."""

from __future__ import annotations

import json

import pytest

from tests.rpc.http_face import API_KEY, http_base, post
from tests.services import start_frontend

MESSAGES = [{"role": "user", "content": "Tell me about Paris"}]


@pytest.fixture(scope="module")
def served(engine_proc):
    frontend = start_frontend(engine_proc.address, extra=("--http-port", "0", "--api-key", API_KEY))
    try:
        yield http_base(frontend)
    finally:
        frontend.terminate()


def chunks(base: str, path: str, body: dict) -> list[dict]:
    lines = post(base, path, {**body, "stream": True}).text.splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_a_chat_streams_last_chunk_has_an_empty_delta(served):
    body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    got = chunks(served, "/v1/chat/completions", body)
    assert got[0]["choices"][0]["delta"]["role"] == "assistant"
    last = got[-1]["choices"][0]
    assert last["finish_reason"] == "length" and last["delta"] == {}
    assert all("content" not in c["choices"][0]["delta"] or c["choices"][0]["delta"]["content"] for c in got[1:])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_needs_include_usage(served, path):
    body = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    body |= {"prompt": "The river"} if path == "/v1/completions" else {"messages": MESSAGES}
    alone = chunks(served, path, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c for c in alone)
    both = chunks(served, path, {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert all(c["usage"] is not None for c in both) and both[-1]["choices"] == []
