"""Engines that cannot serve a frontend's calls: one that hangs (SIGSTOP) and one that
serves another model. Neither may hold a call for long or receive a request it cannot
serve; calls that streamed nothing yet move to a healthy engine unnoticed."""

from __future__ import annotations

import asyncio
import shutil
import signal
import time
import urllib.request

import grpc
import pytest

from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tests.reliability.faults import SERVING, CallRecord, free_port, read_call, request, wait_health
from tests.rpc.frontend_calls import engine_load, stub_of
from tests.services import start_engine, start_frontend

STALL_S = 2.0  # --engine-stall-timeout-s of the frontend under test


async def test_a_hung_engine_fails_or_moves_its_calls_in_bounded_time(demo_model_dir, procs):
    hung = procs(start_engine(demo_model_dir, "--num-kv-blocks", "256")).wait_serving()
    healthy = procs(start_engine(demo_model_dir, "--num-kv-blocks", "256")).wait_serving()
    frontend = procs(
        start_frontend(hung.address, healthy.address, extra=("--engine-stall-timeout-s", str(STALL_S)))
    ).wait_serving()
    try:
        async with grpc.aio.insecure_channel(frontend.address) as channel:
            stub = stub_of(channel)
            # Four long calls, streaming: least outstanding work puts two on each engine.
            started = [asyncio.Event() for _ in range(4)]
            streaming = [CallRecord(max_tokens=1500) for _ in range(4)]
            readers = [
                asyncio.create_task(read_call(stub.Generate(request(f"long {i}", max_tokens=1500)), r, e))
                for i, (r, e) in enumerate(zip(streaming, started))
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            on_hung = (await engine_load(hung.address)).num_running
            assert on_hung >= 1

            hung.proc.send_signal(signal.SIGSTOP)
            stopped_at = time.monotonic()
            # New short calls: some are routed to the hung engine before it is found out;
            # they streamed nothing, so they are retried on the healthy one.
            short = [CallRecord(max_tokens=8) for _ in range(4)]
            await asyncio.wait_for(
                asyncio.gather(
                    *(read_call(stub.Generate(request(f"short {i}", max_tokens=8)), r) for i, r in enumerate(short))
                ),
                STALL_S + 20,
            )
            for r in short:
                assert r.code == grpc.StatusCode.OK and len(r.token_ids) == 8, r
            # A short call the router sent to the hung engine is retried on the healthy one; on a
            # fast machine the healthy engine's long calls are so far ahead that it takes every
            # short call (least outstanding work), and then every one says so in its log line.
            # A call's log line is written as it ends, after its answer: wait for the lines.
            deadline = time.monotonic() + 10
            log = frontend.log()
            while log.count(f"engine={healthy.address} ") < len(short) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                log = frontend.log()
            if "trying another engine" not in log:
                assert log.count(f"engine={healthy.address} ") >= len(short), log[-3000:]

            # The hung engine's streaming calls end UNAVAILABLE, saying why; the others go on
            # (still streaming, or finished whole where the healthy engine is fast enough).
            done, pending = await asyncio.wait(readers, timeout=STALL_S + 10)
            failed = [t.result() for t in done if t.result().code != grpc.StatusCode.OK]
            assert len(failed) == on_hung, ([t.result() for t in done], on_hung)
            for r in failed:
                assert r.code == grpc.StatusCode.UNAVAILABLE and "it is hung" in r.details, r
                assert r.ended_at - stopped_at < STALL_S + 8
            for task in done:
                if task.result().code == grpc.StatusCode.OK:
                    assert len(task.result().token_ids) == 1500, task.result()
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

            # From now on only the healthy engine gets calls, and the frontend stays SERVING.
            await wait_health(frontend, SERVING, timeout=5)
            assert (await stub.GetModelInfo(g.GetModelInfoRequest())).num_engines == 1
            retries = frontend.log().count("trying another engine")
            records = [CallRecord(max_tokens=4) for _ in range(4)]
            await asyncio.gather(
                *(read_call(stub.Generate(request(f"after {i}", max_tokens=4)), r) for i, r in enumerate(records))
            )
            assert all(r.code == grpc.StatusCode.OK for r in records), records
            assert frontend.log().count("trying another engine") == retries  # none went to the hung engine
    finally:
        hung.proc.send_signal(signal.SIGCONT)
        hung.kill()


@pytest.fixture
def renamed_tokenizer_model(demo_model_dir, tmp_path):
    """The demo model with a chat template of its own: the same weights and vocabulary, another
    tokenizer_config.json."""
    model = tmp_path / "demo-model"
    model.mkdir()
    for f in demo_model_dir.iterdir():
        if f.name == "model.safetensors":
            (model / f.name).symlink_to(f)
        else:
            shutil.copy(f, model / f.name)
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    return model


async def test_engines_serving_another_model_get_no_requests(demo_model_dir, renamed_tokenizer_model, procs):
    metrics_port, renamed_port, retokenized_port = free_port(), free_port(), free_port()
    first = procs(start_engine(demo_model_dir, "--num-kv-blocks", "256")).wait_serving()
    others = (f"127.0.0.1:{renamed_port}", f"127.0.0.1:{retokenized_port}")
    frontend = procs(
        start_frontend(first.address, *others, extra=("--metrics-port", str(metrics_port)))
    ).wait_serving()  # the first engine's model is the one accepted
    # The same weights under another name; the same name with another chat template.
    procs(start_engine(demo_model_dir, "--served-model-name", "another-model", port=renamed_port))
    procs(start_engine(renamed_tokenizer_model, port=retokenized_port))  # also named demo-model
    deadline = time.monotonic() + 60
    while not all(f"engine {address} refused" in frontend.log() for address in others):
        assert time.monotonic() < deadline, frontend.log()
        await asyncio.sleep(0.1)
    why = "it serves another model than the first engine this frontend accepted: "
    assert f"{why}model 'another-model' instead of 'demo-model'" in frontend.log()
    assert f"{why}chat_template.jinja with sha256" in frontend.log()
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        stub = stub_of(channel)
        assert (await stub.GetModelInfo(g.GetModelInfoRequest())).num_engines == 1
        records = [CallRecord(max_tokens=6) for _ in range(8)]
        await asyncio.gather(
            *(read_call(stub.Generate(request(f"call {i}", max_tokens=6)), r) for i, r in enumerate(records))
        )
    assert all(r.code == grpc.StatusCode.OK and len(r.token_ids) == 6 for r in records), records
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as page:
        metrics = page.read().decode()
    assert "tandem_frontend_engines_refused 2.0" in metrics and "tandem_frontend_engines_connected 1.0" in metrics
