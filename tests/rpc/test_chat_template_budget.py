"""A model's chat template is untrusted code: real engine and frontends on 127.0.0.1.

The model serves tests/chat_templates.HOSTILE, ChatML that loops, allocates or recurses
when the last turn asks, so the frontend's start-up test passes and only those requests
meet the template's worst. A render past its budget fails its own request with
INVALID_ARGUMENT naming the template and the flag, while another client's stream, another
chat and both health checks carry on; a template that cannot render its start-up test
conversations is refused at start, naming its file.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tandem_protos.tandem.generate.v1 import generate_pb2_grpc
from tests.chat_templates import HOSTILE, LOOPS_ALWAYS, model_with_template
from tests.rpc.http_face import http_base
from tests.services import ServiceProcess, start_engine, start_frontend

TIMEOUT_S = 3.0  # the render budget here: long enough that the checks beside a stuck render end within it
BUDGET = ("--chat-template-timeout-s", str(TIMEOUT_S), "--chat-template-max-bytes", str(1 << 20))


@pytest.fixture(scope="module")
def hostile_model(demo_model_dir, tmp_path_factory):
    return model_with_template(demo_model_dir, tmp_path_factory.mktemp("hostile") / "model", HOSTILE)


@pytest.fixture(scope="module")
def pair(hostile_model):
    engine = start_engine(hostile_model, "--num-kv-blocks", "512")
    frontend = None
    try:
        engine.wait_serving()
        frontend = start_frontend(engine.address, extra=("--http-port", "0", *BUDGET))
        yield engine, frontend.wait_serving()
    finally:
        if frontend is not None:
            frontend.terminate()
        engine.terminate()


def chat(text: str, max_tokens: int = 2) -> g.GenerateRequest:
    messages = g.ChatMessages(messages=[g.ChatMessage(role="user", content=text)])
    return g.GenerateRequest(messages=messages, sampling_params=g.SamplingParams(max_tokens=max_tokens))


async def status_of(call) -> grpc.StatusCode:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def grpc_health(address: str) -> int | None:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            return None
        return response.status


async def test_a_render_that_never_ends_fails_its_request_alone(pair):
    _, frontend = pair
    base = http_base(frontend)
    async with (
        grpc.aio.insecure_channel(frontend.address) as victim_channel,
        grpc.aio.insecure_channel(frontend.address) as attacker_channel,
    ):
        victim = generate_pb2_grpc.GenerateServiceStub(victim_channel)
        times: list[float] = []

        async def read_victim() -> None:  # another client's stream, read as it comes
            request = g.GenerateRequest(
                text="victim", sampling_params=g.SamplingParams(max_tokens=1500, ignore_eos=True, temperature=0)
            )
            async for _ in victim.Generate(request, timeout=120):
                times.append(time.monotonic())

        streaming = asyncio.create_task(read_victim())
        while not times:
            await asyncio.sleep(0.02)
        attack = generate_pb2_grpc.GenerateServiceStub(attacker_channel).Generate(chat("loop"), timeout=60)
        attacked = asyncio.create_task(attack.code())
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        # Beside the stuck render: both health checks, another chat, and the victim's tokens.
        assert await grpc_health(frontend.address) == health_pb2.HealthCheckResponse.SERVING
        async with httpx.AsyncClient() as client:
            health = await client.get(base + "/health", timeout=2)
        assert health.status_code == 200
        assert await status_of(victim.Generate(chat("hello"), timeout=10)) == grpc.StatusCode.OK
        assert not attacked.done(), "the checks beside the render took longer than its budget"
        assert any(t > t0 for t in times), "the victim's stream stalled"

        assert await asyncio.wait_for(attacked, 30) == grpc.StatusCode.INVALID_ARGUMENT
        details = await attack.details()
        assert "chat_template.jinja" in details and "--chat-template-timeout-s" in details, details
        streaming.cancel()
        await asyncio.gather(streaming, return_exceptions=True)

        # The render process stopped that render itself and serves on.
        assert await status_of(victim.Generate(chat("hello again"), timeout=30)) == grpc.StatusCode.OK


async def test_a_size_bomb_fails_at_once_naming_the_budget(pair):
    _, frontend = pair
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        call = generate_pb2_grpc.GenerateServiceStub(channel).Generate(chat("bomb"), timeout=30)
        assert await call.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = await call.details()
    assert "--chat-template-max-bytes" in details and "300000000" in details, details


async def test_recursion_is_invalid_argument_on_both_faces(pair):
    _, frontend = pair
    base = http_base(frontend)
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        call = stub.Generate(chat("recurse"), timeout=30)
        assert await call.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "recursed too deep" in await call.details()

        # Tool parameters and a tool call's arguments nested 1,000 levels deep.
        deep = '{"type": "object", "properties": {"x": ' * 500 + "{}" + "}}" * 500
        tools = [g.Tool(name="deep", parameters=deep)]
        call = stub.Generate(g.GenerateRequest(messages=chat("hi").messages, tools=tools), timeout=30)
        assert await call.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (await call.details()).startswith("tools[0].parameters: nests objects and arrays")
        turns = [
            g.ChatMessage(role="user", content="hi"),
            g.ChatMessage(role="assistant", tool_calls=[g.ToolCall(id="1", name="f", arguments="[" * 1000)]),
        ]
        call = stub.Generate(g.GenerateRequest(messages=g.ChatMessages(messages=turns)), timeout=30)
        assert await call.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "messages.messages[1].tool_calls[0].arguments" in await call.details()

    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        body = {"model": "model", "max_tokens": 2, "messages": [{"role": "user", "content": "recurse"}]}
        answer = await client.post("/v1/chat/completions", json=body)
        assert answer.status_code == 400 and "recursed too deep" in answer.text, answer.text
        parameters: dict = {}
        for _ in range(300):  # 600 levels: deep, yet within what the body's own JSON parse takes
            parameters = {"type": "object", "properties": {"x": parameters}}
        tool = {"type": "function", "function": {"name": "deep", "parameters": parameters}}
        body = {"model": "model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
        answer = await client.post("/v1/chat/completions", json=body)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == "tools[0].function.parameters", answer.text


def test_a_template_past_its_budget_on_the_start_up_test_is_refused(demo_model_dir, tmp_path):
    """Fetched from the engines: NOT_SERVING, said at ERROR, calls FAILED_PRECONDITION naming the file."""
    model = model_with_template(demo_model_dir, tmp_path / "loops", LOOPS_ALWAYS)
    engine = start_engine(model, "--num-kv-blocks", "64")
    frontend: ServiceProcess | None = None
    try:
        engine.wait_serving()
        frontend = start_frontend(engine.address, extra=("--chat-template-timeout-s", "0.5"))
        deadline = time.monotonic() + 60
        while "did not finish rendering" not in frontend.log() and time.monotonic() < deadline:
            assert frontend.health() != health_pb2.HealthCheckResponse.SERVING, "served a template that never ends"
            time.sleep(0.1)
        assert "chat_template.jinja of model 'loops'" in frontend.log(), frontend.log()
        assert frontend.health() == health_pb2.HealthCheckResponse.NOT_SERVING
        request = g.GenerateRequest(text="hi", sampling_params=g.SamplingParams(max_tokens=2))
        with grpc.insecure_channel(frontend.address) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                list(generate_pb2_grpc.GenerateServiceStub(channel).Generate(request, timeout=10))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (
            "chat_template.jinja" in refused.value.details() and "--chat-template-timeout-s" in refused.value.details()
        )
    finally:
        if frontend is not None:
            frontend.terminate()
        engine.terminate()


@pytest.mark.parametrize(
    "template, why",
    [
        (LOOPS_ALWAYS, "did not finish rendering"),
        ("{{ raise_exception('no conversation suits me') }}", "renders none of the start-up test conversations"),
        ("{% for message in messages %}", "does not compile"),
    ],
    ids=["loops", "never-renders", "does-not-compile"],
)
def test_a_tokenizer_dir_whose_template_cannot_serve_stops_the_frontend(demo_model_dir, tmp_path, template, why):
    model = model_with_template(demo_model_dir, tmp_path / "model", template)
    frontend = start_frontend("127.0.0.1:1", extra=("--tokenizer", str(model), "--chat-template-timeout-s", "0.5"))
    try:
        code = frontend.proc.wait(60)
    finally:
        frontend.terminate()
    assert code != 0
    assert f"{model / 'chat_template.jinja'}" in frontend.log() and why in frontend.log(), frontend.log()


@pytest.mark.parametrize("stop", ["terminate", "kill"])
def test_no_render_process_outlives_its_frontend(pair, stop):
    engine, _ = pair
    frontend = start_frontend(engine.address).wait_serving()
    try:
        main = frontend.proc.pid
        children = [int(p) for p in open(f"/proc/{main}/task/{main}/children").read().split()]
        assert len(children) == 2, children  # --chat-template-workers' default
        getattr(frontend, stop)()  # SIGTERM: the frontend closes them; SIGKILL: they die with it
        deadline = time.monotonic() + 30
        while any(_running(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_running(p) for p in children)
    finally:
        frontend.terminate()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
