"""LoRA adapters end to end: real engines and a frontend on 127.0.0.1, the random demo model.

An adapter is loaded into a running engine over gRPC, used through the frontend's public
API (gRPC ``model`` and the OpenAI HTTP face's ``model``) with PEFT's own greedy output as
the reference, refused while requests use it, unloaded; unknown names and unservable
adapters are refused with their status. With two engines of which only one serves an
adapter, every request under it goes there.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import urllib.request

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tandem_protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc
from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tests.lora_factory import load_peft_model, make_adapter
from tests.reliability.faults import free_port
from tests.rpc.frontend_calls import generate, ids_of, stub_of
from tests.rpc.http_face import http_base
from tests.services import start_engine, start_frontend

PROMPT = [11, 202, 303, 404, 505, 606, 707, 808, 909, 1001, 1102, 1203]
NUM_NEW = 8
GREEDY = dict(max_tokens=NUM_NEW, min_tokens=NUM_NEW, temperature=0.0)


@pytest.fixture(scope="module")
def adapters(demo_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    a = make_adapter(demo_model_dir, root / "a", r=8, alpha=16, seed=1)
    b = make_adapter(demo_model_dir, root / "b", r=4, alpha=8, seed=2, targets=("q_proj", "v_proj"))
    dora = root / "dora"
    shutil.copytree(a, dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    return {"a": a, "b": b, "dora": dora}


def _peft_greedy(model_dir, adapter) -> list[int]:
    model = load_peft_model(model_dir, adapter)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False, pad_token_id=0
        )
    return out[0, len(PROMPT) :].tolist()


async def _engine_call(address: str, method: str, request):
    async with grpc.aio.insecure_channel(address) as channel:
        return await getattr(engine_pb2_grpc.EngineServiceStub(channel), method)(request, timeout=30)


async def _status_of(coro) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await coro
    return e.value.code(), e.value.details()


def test_load_use_refuse_and_unload_an_adapter_at_run_time(demo_model_dir, adapters):
    metrics_port = free_port()
    engine = start_engine(
        demo_model_dir,
        "--enable-lora",
        "--num-kv-blocks",
        "256",
        "--dtype",
        "float32",
        "--metrics-port",
        str(metrics_port),
    )
    frontend = None
    try:
        engine.wait_serving()
        frontend = start_frontend(engine.address, extra=("--http-port", "0"))
        frontend.wait_serving()
        asyncio.run(_load_use_unload(engine.address, frontend.address, http_base(frontend), demo_model_dir, adapters))
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as page:
            metrics = {
                (sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for family in text_string_to_metric_families(page.read().decode())
                for sample in family.samples
            }
        # The greedy call, the HTTP one and the long one cancelled ran under "a"; the call
        # after the unload, refused whether by the frontend or the engine, is not counted.
        assert metrics[("tandem_engine_lora_requests_finished_total", (("adapter", "a"),))] == 3
        assert metrics[("tandem_engine_lora_adapter_events_total", (("event", "load"),))] == 1
        assert metrics[("tandem_engine_lora_adapter_events_total", (("event", "unload"),))] == 1
        assert metrics[("tandem_engine_lora_adapters_loaded", ())] == 0
    finally:
        if frontend is not None:
            frontend.terminate()
        engine.terminate()


async def _load_use_unload(engine, frontend, http, model_dir, adapters) -> None:
    load = engine_pb2.LoadLoraAdapterRequest
    loaded = await _engine_call(engine, "LoadLoraAdapter", load(name="a", path=str(adapters["a"])))
    assert loaded.adapter.name == "a" and len(loaded.adapter.digest) == 32 and loaded.adapter.max_rank == 8
    async with grpc.aio.insecure_channel(frontend) as channel:
        stub = stub_of(channel)
        # The frontend learns of the adapter when a request names it (or from the engine's load report).
        base = ids_of(await generate(stub, token_ids=PROMPT, params=GREEDY))
        under_a = ids_of(await generate(stub, token_ids=PROMPT, params=GREEDY, model="a"))
        assert under_a == _peft_greedy(model_dir, adapters["a"]) and under_a != base
        info = await stub.GetModelInfo(g.GetModelInfoRequest(), timeout=10)
        assert list(info.lora_adapters) == ["a"]
        # By the served model's own name: the base model.
        assert ids_of(await generate(stub, token_ids=PROMPT, params=GREEDY, model=info.model_name)) == base

        code, details = await _status_of(generate(stub, token_ids=PROMPT, params=GREEDY, model="nope"))
        assert code is grpc.StatusCode.NOT_FOUND and "'nope'" in details and "'a'" in details
        code, details = await _status_of(
            _engine_call(engine, "LoadLoraAdapter", load(name="a", path=str(adapters["b"])))
        )
        assert code is grpc.StatusCode.ALREADY_EXISTS
        code, details = await _status_of(
            _engine_call(engine, "LoadLoraAdapter", load(name="d", path=str(adapters["dora"])))
        )
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "use_dora" in details
        code, details = await _status_of(_engine_call(engine, "LoadLoraAdapter", load(name="x", path="/nonexistent")))
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "/nonexistent" in details

        # HTTP: /v1/models lists the adapter under its parent; its model name runs under it.
        with urllib.request.urlopen(f"{http}/v1/models", timeout=10) as page:
            models = json.load(page)["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [(info.model_name, None), ("a", info.model_name)]
        body = json.dumps(
            {"model": "a", "prompt": PROMPT, "max_tokens": NUM_NEW, "min_tokens": NUM_NEW, "temperature": 0}
        )
        http_request = urllib.request.Request(
            f"{http}/v1/completions", body.encode(), {"content-type": "application/json"}
        )
        with urllib.request.urlopen(http_request, timeout=60) as page:
            completion = json.load(page)
        assert completion["model"] == "a" and completion["usage"]["completion_tokens"] == NUM_NEW

        # Refused while a request uses it (its first token is out); unloaded once it ended.
        long = stub.Generate(
            g.GenerateRequest(
                token_ids=g.TokenIds(ids=PROMPT),
                sampling_params=g.SamplingParams(max_tokens=1500, ignore_eos=True),
                model="a",
            ),
            timeout=120,
        )
        await long.read()
        unload = engine_pb2.UnloadLoraAdapterRequest(name="a")
        code, details = await _status_of(_engine_call(engine, "UnloadLoraAdapter", unload))
        assert code is grpc.StatusCode.FAILED_PRECONDITION and "unfinished" in details
        long.cancel()
        for _ in range(100):  # the engine finishes the aborted request within a step or two
            try:
                await _engine_call(engine, "UnloadLoraAdapter", unload)
                break
            except grpc.aio.AioRpcError as e:
                assert e.code() is grpc.StatusCode.FAILED_PRECONDITION
                await asyncio.sleep(0.05)
        code, _ = await _status_of(generate(stub, token_ids=PROMPT, params=GREEDY, model="a"))
        assert code is grpc.StatusCode.NOT_FOUND


def test_requests_under_an_adapter_go_only_to_the_engines_that_serve_it(demo_model_dir, adapters):
    plain = start_engine(demo_model_dir, "--num-kv-blocks", "256")
    with_lora = start_engine(demo_model_dir, "--num-kv-blocks", "256", "--lora-modules", f"b={adapters['b']}")
    frontend = None
    try:
        plain.wait_serving()
        with_lora.wait_serving()
        frontend = start_frontend(plain.address, with_lora.address)
        frontend.wait_serving()

        async def calls():
            async with grpc.aio.insecure_channel(frontend.address) as channel:
                stub = stub_of(channel)
                results = await asyncio.gather(
                    *(generate(stub, token_ids=PROMPT, params=GREEDY, model="b") for _ in range(8)),
                    *(generate(stub, token_ids=PROMPT, params=GREEDY) for _ in range(4)),
                )
            return [ids_of(r) for r in results]

        results = asyncio.run(calls())
        # The plain engine would have refused any "b" request with NOT_FOUND: all 8 went to the other.
        assert all(r == results[0] for r in results[:8]) and results[0] != results[8]
        assert all(r == results[8] for r in results[8:])
    finally:
        if frontend is not None:
            frontend.terminate()
        plain.terminate()
        with_lora.terminate()
