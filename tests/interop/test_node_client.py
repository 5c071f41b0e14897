"""A Node.js client (@grpc/grpc-js + @grpc/proto-loader) against a running frontend.

The client (tests/interop/node/client.js) loads protos/tandem/generate/v1/generate.proto at
run time, streams a generation, cancels another mid-stream and reads status errors, then
prints what it saw as JSON. Its dependencies are installed with ``npm ci`` into
tests/interop/node/node_modules (git-ignored) the first time and reused afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tests.rpc.frontend_calls import generate, ids_of, stub_of, wait_engine_idle
from tests.services import ROOT

NODE_DIR = Path(__file__).resolve().parent / "node"
NPM_TIMEOUT_S = 300


def node_client_ready() -> str:
    """Path of node; installs the client's dependencies when missing; skips without node or npm."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("Node.js interop needs node and npm on PATH")
    if all(
        (NODE_DIR / "node_modules" / "@grpc" / name / "package.json").exists() for name in ("grpc-js", "proto-loader")
    ):
        return node
    result = subprocess.run(
        [npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts", "--cache", str(NODE_DIR / ".npm-cache")],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=NPM_TIMEOUT_S,
    )
    if result.returncode != 0:
        pytest.skip(f"npm ci failed in {NODE_DIR} (is the npm registry reachable?): {result.stderr[-400:]}")
    return node


def run_node_client(node: str, address: str, env: dict[str, str] | None = None) -> dict:
    result = subprocess.run(
        [node, "client.js", address, str(ROOT / "protos")],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, f"node client failed ({result.returncode}):\n{result.stderr}"
    return json.loads(result.stdout)


async def test_node_client_streams_cancels_and_reads_errors(services):
    node = node_client_ready()
    engine, frontend = services
    seen = await asyncio.to_thread(run_node_client, node, frontend.address)

    async with grpc.aio.insecure_channel(frontend.address) as channel:
        stub = stub_of(channel)
        info = await stub.GetModelInfo(g.GetModelInfoRequest())
        tokenized = await stub.Tokenize(g.TokenizeRequest(text="Hello from Node"))
        expected = await generate(
            stub, text="Once upon a time", params=dict(max_tokens=8, temperature=0.0, ignore_eos=True)
        )
    assert seen["model_info"] == {
        "model_name": info.model_name,
        "max_model_len": info.max_model_len,
        "vocab_size": info.vocab_size,
    }
    assert seen["tokenize"] == {"token_ids": list(tokenized.token_ids), "tokens": list(tokenized.tokens)}

    stream = seen["stream"]
    assert stream["status"]["code_name"] == "OK" and stream["num_responses"] >= 2
    assert stream["finish_reason"] == "FINISH_REASON_LENGTH" and stream["matched_stop"] is None
    assert stream["usage"]["completion_tokens"] == 8 == len(stream["token_ids"])
    assert stream["token_ids"] == ids_of(expected)  # greedy: the same tokens as a Python client gets
    assert stream["text"] == stream["detokenized"] == "".join(r.text for r in expected)

    # The cancelled call saw its first pieces, then CANCELLED; the engine stopped computing it.
    assert seen["cancel"]["received"] == 3
    assert seen["cancel"]["status"]["code_name"] == "CANCELLED"
    await wait_engine_idle(engine.address, timeout=5)

    assert seen["invalid"] == {
        "num_responses": 0,
        "status": {
            "code": 3,
            "code_name": "INVALID_ARGUMENT",
            "details": "sampling_params.top_p: must be in (0, 1], got 2.0",
        },
    }
    assert seen["unary_error"]["code_name"] == "INVALID_ARGUMENT"
    assert seen["unary_error"]["details"].startswith("token_ids: token_ids[1] = 10000000 is outside the vocabulary")
