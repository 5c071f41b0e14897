"""cache_salt: a prompt reuses prefix-cache blocks only of requests with the same salt,
over gRPC (GenerateRequest.cache_salt) and HTTP (vLLM's cache_salt), on the engine's own
counts of cached tokens."""

from __future__ import annotations

import grpc
import pytest

from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tests.rpc.http_face import API_KEY, grpc_stream, http_base, post
from tests.services import start_frontend

PROMPT = "The old mill stood by the river, and every morning the miller opened its doors. " * 3


@pytest.fixture(scope="module")
def served(engine_proc):
    frontend = start_frontend(engine_proc.address, extra=("--http-port", "0", "--api-key", API_KEY))
    try:
        yield frontend.address, http_base(frontend)
    finally:
        frontend.terminate()


def http_cached(base: str, prompt: str, **salt) -> int:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0, **salt}
    response = post(base, "/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def grpc_cached(address: str, prompt: str, salt: str = "") -> int:
    request = g.GenerateRequest(text=prompt, cache_salt=salt, sampling_params=g.SamplingParams(max_tokens=1))
    return grpc_stream(address, request)[-1].usage.cached_tokens


def test_http_cache_salt_shares_blocks_only_within_a_salt(served):
    _, base = served
    prompt = "HTTP. " + PROMPT
    assert http_cached(base, prompt, cache_salt="alice") == 0
    assert http_cached(base, prompt, cache_salt="alice") > 0
    assert http_cached(base, prompt, cache_salt="bob") == 0
    assert http_cached(base, prompt) == 0  # the shared cache holds none of the salted blocks
    assert http_cached(base, prompt) > 0
    assert http_cached(base, prompt, cache_salt="bob") > 0


def test_grpc_cache_salt_shares_blocks_only_within_a_salt(served):
    address, base = served
    prompt = "gRPC. " + PROMPT
    assert grpc_cached(address, prompt, "alice") == 0
    assert grpc_cached(address, prompt, "alice") > 0
    assert grpc_cached(address, prompt, "bob") == 0
    assert grpc_cached(address, prompt) == 0
    assert http_cached(base, prompt, cache_salt="alice") > 0  # one salt, one cache, whichever face


@pytest.mark.parametrize(
    "body,param",
    [
        ({"cache_salt": ""}, "cache_salt"),
        ({"cache_salt": 7}, "cache_salt"),
        ({"cache_salt": "x" * 1025}, "cache_salt"),
        ({"session_id": "s1"}, "session_id"),
    ],
)
def test_bad_salts_and_session_id_are_refused(served, body, param):
    response = post(served[1], "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_a_grpc_salt_past_its_limit_is_invalid(served):
    request = g.GenerateRequest(text="hi", cache_salt="x" * 1025, sampling_params=g.SamplingParams(max_tokens=1))
    with pytest.raises(grpc.RpcError) as e:
        grpc_stream(served[0], request)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in e.value.details()
