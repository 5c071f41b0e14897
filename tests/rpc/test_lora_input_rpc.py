"""LoRA adapters as untrusted input, end to end: a real engine and frontend on 127.0.0.1.

A hostile adapter config is answered at once while another client's base-model stream
runs on: a ``rank_pattern`` key that Python's ``re`` would backtrack on for hours (holding
the GIL, so the step loop stops too) is refused by name if RE2 cannot take it, and costs
nothing if it can. An adapter the engine has just loaded is served by the frontend at
once, even right after the frontend answered NOT_FOUND for the same name.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import grpc
import pytest

from tandem_protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc
from tests.lora_factory import make_adapter
from tests.rpc.frontend_calls import generate, ids_of, stub_of
from tests.services import start_engine, start_frontend

PROMPT = [11, 202, 303, 404, 505, 606, 707, 808]


@pytest.fixture(scope="module")
def adapter(demo_model_dir, tmp_path_factory):
    return make_adapter(demo_model_dir, tmp_path_factory.mktemp("adapters") / "a", r=4, alpha=8, seed=1)


@pytest.fixture(scope="module")
def lora_pair(demo_model_dir):
    engine = start_engine(demo_model_dir, "--enable-lora", "--num-kv-blocks", "256", "--max-cpu-loras", "8")
    frontend = None
    try:
        engine.wait_serving()
        frontend = start_frontend(engine.address).wait_serving()
        yield engine, frontend
    finally:
        if frontend is not None:
            frontend.terminate()
        engine.terminate(timeout=10)


def _with_pattern(adapter, root, pattern: dict):
    out = root / f"hostile-{len(list(root.iterdir()))}"
    shutil.copytree(adapter, out)
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps(config | {"rank_pattern": pattern}))
    return out


async def _load(engine_address: str, name: str, path) -> tuple[grpc.StatusCode, str, float]:
    start = time.monotonic()
    async with grpc.aio.insecure_channel(engine_address) as channel:
        try:
            await engine_pb2_grpc.EngineServiceStub(channel).LoadLoraAdapter(
                engine_pb2.LoadLoraAdapterRequest(name=name, path=str(path)), timeout=30
            )
            return grpc.StatusCode.OK, "", time.monotonic() - start
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details(), time.monotonic() - start


def test_a_hostile_pattern_is_answered_at_once_while_a_base_model_stream_runs(lora_pair, adapter, tmp_path):
    engine, frontend = lora_pair
    refused = _with_pattern(adapter, tmp_path, {"(.|.)*(?=Z)": 4})  # re: exponential; RE2: no look-ahead
    harmless = _with_pattern(adapter, tmp_path, {"(.|.)*Z": 4})  # re: exponential; RE2: linear, matches nothing

    async def scenario():
        async with grpc.aio.insecure_channel(frontend.address) as channel:
            victim = asyncio.ensure_future(
                generate(
                    stub_of(channel),
                    token_ids=PROMPT,
                    params=dict(max_tokens=300, temperature=0.0, ignore_eos=True),
                    timeout=90,
                )
            )
            await asyncio.sleep(1)
            first = await _load(engine.address, "refused", refused)
            second = await _load(engine.address, "harmless", harmless)
            return first, second, await victim

    (code, details, _), (code2, details2, _), victim = asyncio.run(scenario())
    assert code is grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "rank_pattern key '(.|.)*(?=Z)'" in details and str(refused) in details, details
    assert "\n" not in details
    assert code2 is grpc.StatusCode.OK, details2
    assert len(ids_of(victim)) == 300


def test_an_adapter_just_loaded_is_served_at_once(lora_pair, adapter):
    engine, frontend = lora_pair

    async def scenario() -> list[tuple[str, grpc.StatusCode]]:
        outcomes = []
        async with grpc.aio.insecure_channel(frontend.address) as channel:
            stub = stub_of(channel)
            for i in range(3):
                name = f"fresh-{i}"
                with pytest.raises(grpc.aio.AioRpcError) as before:
                    await generate(stub, token_ids=PROMPT, params=dict(max_tokens=2), model=name, timeout=30)
                assert before.value.code() is grpc.StatusCode.NOT_FOUND
                code, details, _ = await _load(engine.address, name, adapter)
                assert code is grpc.StatusCode.OK, details
                try:  # at once: within the second the frontend may wait before asking the engine again
                    await generate(stub, token_ids=PROMPT, params=dict(max_tokens=2), model=name, timeout=30)
                    outcomes.append((name, grpc.StatusCode.OK))
                except grpc.aio.AioRpcError as e:
                    outcomes.append((name, e.code()))
        return outcomes

    assert asyncio.run(scenario()) == [(f"fresh-{i}", grpc.StatusCode.OK) for i in range(3)]
