"""`buf curl` (PyPI: buf-bin) against the frontend: gRPC over HTTP/2 without TLS, schema by reflection."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.interop.jsonstream import json_objects

GENERATE = "tandem.generate.v1.GenerateService"


def buf_path() -> str:
    local = Path(sys.executable).parent / "buf"
    found = str(local) if local.exists() else shutil.which("buf")
    if not found:
        raise RuntimeError("buf is not installed: install the test extra (pip install -e '.[test]')")
    return found


def buf_curl(*args: str) -> subprocess.CompletedProcess:
    argv = [buf_path(), "curl", "--protocol", "grpc", "--http2-prior-knowledge", "--timeout", "60s", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=90)


def call(address: str, method: str, data: object) -> subprocess.CompletedProcess:
    return buf_curl("--data", json.dumps(data), f"http://{address}/{method}")


def test_buf_curl_lists_calls_and_reads_errors(services):
    _, frontend = services
    listed = buf_curl("--list-methods", f"http://{frontend.address}")
    assert listed.returncode == 0, listed.stderr
    assert {f"{GENERATE}/{m}" for m in ("Generate", "Tokenize", "Detokenize", "GetModelInfo")} <= set(
        listed.stdout.split()
    )

    health = call(frontend.address, "grpc.health.v1.Health/Check", {"service": GENERATE})
    assert health.returncode == 0 and json.loads(health.stdout) == {"status": "SERVING"}, health.stderr

    tokenized = call(frontend.address, f"{GENERATE}/Tokenize", {"text": "hello world", "add_special_tokens": False})
    assert tokenized.returncode == 0, tokenized.stderr
    # buf curl prints JSON field names (camelCase), grpcurl prints proto names.
    assert "".join(json.loads(tokenized.stdout)["tokens"]) == "hello world"

    streamed = call(
        frontend.address,
        f"{GENERATE}/Generate",
        {
            "text": "hello",
            "return_token_ids": True,
            "sampling_params": {"max_tokens": 5, "temperature": 0, "ignore_eos": True},
        },
    )
    assert streamed.returncode == 0, streamed.stderr
    pieces = json_objects(streamed.stdout)
    assert len(pieces) > 1 and pieces[-1]["finishReason"] == "FINISH_REASON_LENGTH"
    assert pieces[-1]["usage"]["completionTokens"] == 5
    assert sum(len(p.get("tokenIds", [])) for p in pieces) == 5

    bad = call(frontend.address, f"{GENERATE}/Generate", {"text": "hi", "sampling_params": {"n": 0}})
    assert bad.returncode != 0 and bad.stdout == ""
    assert json.loads(bad.stderr) == {
        "code": "invalid_argument",
        "message": "sampling_params.n: must be in [1, 16], got 0",
    }
