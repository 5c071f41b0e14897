"""LoRA adapters loaded and unloaded over HTTP (vLLM's routes) on every engine at once: two
real engines with --enable-lora behind one frontend with --http-lora-admin, raw httpx."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from tandem_protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc
from tests.lora_factory import make_adapter
from tests.rpc.http_face import API_KEY, http_base, post
from tests.services import start_engine, start_frontend


@pytest.fixture(scope="module")
def adapter(demo_model_dir, tmp_path_factory):
    return make_adapter(demo_model_dir, tmp_path_factory.mktemp("adapters") / "a", r=4, alpha=8, seed=3)


@pytest.fixture(scope="module")
def pair_of_engines(demo_model_dir):
    engines = [start_engine(demo_model_dir, "--enable-lora", "--num-kv-blocks", "128") for _ in range(2)]
    extra = ("--http-port", "0", "--api-key", API_KEY, "--http-lora-admin")
    frontend = None
    try:
        for e in engines:
            e.wait_serving()
        frontend = start_frontend(*(e.address for e in engines), extra=extra)
        yield engines, frontend, http_base(frontend)
    finally:
        if frontend is not None:
            frontend.terminate()
        for e in engines:
            e.terminate()


def _adapters(address: str) -> list[str]:
    async def ask():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            info = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=30)
        return sorted(a.name for a in info.lora_adapters)

    return asyncio.run(ask())


def test_load_use_and_unload_on_every_engine(pair_of_engines, adapter):
    engines, frontend, base = pair_of_engines
    load = {"lora_name": "a", "lora_path": str(adapter)}
    assert post(base, "/v1/load_lora_adapter", load, key=None).status_code == 401

    r = post(base, "/v1/load_lora_adapter", load)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a' added successfully."
    assert [_adapters(e.address) for e in engines] == [["a"], ["a"]]
    models = httpx.get(base + "/v1/models", headers={"x-api-key": API_KEY}).json()["data"]
    assert "a" in [m["id"] for m in models]
    completion = post(base, "/v1/completions", {"model": "a", "prompt": "Hello", "max_tokens": 3})
    assert completion.status_code == 200 and completion.json()["model"] == "a"

    again = post(base, "/v1/load_lora_adapter", load)
    assert again.status_code == 400 and again.json()["error"]["code"] == "already_exists"
    assert [_adapters(e.address) for e in engines] == [["a"], ["a"]]  # refused everywhere, undone nowhere

    r = post(base, "/v1/unload_lora_adapter", {"lora_name": "a"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a' removed successfully."
    assert [_adapters(e.address) for e in engines] == [[], []]
    gone = post(base, "/v1/unload_lora_adapter", {"lora_name": "a"})
    assert gone.status_code == 404 and "no engine serves a LoRA adapter named 'a'" in gone.json()["error"]["message"]
    assert "LoRA admin: on" in frontend.log() and "LoRA adapter 'a' loaded from" in frontend.log()


def test_a_load_that_fails_loads_nowhere_and_bad_bodies_are_refused(pair_of_engines, tmp_path):
    engines, _, base = pair_of_engines
    r = post(base, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "none")})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_argument"
    assert [_adapters(e.address) for e in engines] == [[], []]
    r = post(base, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = post(base, "/v1/unload_lora_adapter", {"lora_name": "x", "lora_int_id": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_int_id"


def test_without_the_flag_the_routes_do_not_exist(engine_proc):
    frontend = start_frontend(engine_proc.address, extra=("--http-port", "0", "--api-key", API_KEY))
    try:
        r = post(http_base(frontend), "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"})
        assert r.status_code == 404
    finally:
        frontend.terminate()
