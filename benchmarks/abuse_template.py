"""Abuse scenarios aimed at the model's chat template, registered in benchmarks.abuse (same command line).

    template-loop       a chat whose template runs two nested range(100000) loops: its status, and
                        beside it another client's stream, another chat, /health, frontend RSS
    template-bomb       a chat whose template makes 'a' * 1500000000: its status, frontend RSS, /health
    template-recursion  a recursive macro; tool parameters nested 1,000 levels: their statuses
    template-start      a template that never finishes on any conversation: what health says

Each starts an engine and a frontend (default flags, HTTP face on) on a copy of the demo
model whose chat template is ChatML that misbehaves when the last turn says "attack", so
that an ordinary chat to the same frontend still works. The templates are written here, so the
file runs as it is from an older checkout (copied into its benchmarks/).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import grpc
import httpx

from benchmarks.abuse_kit import Victim, outcome, rss_mib
from tandem_common.ready import read_ready_file
from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tandem_protos.tandem.generate.v1 import generate_pb2_grpc
from tests.chat_templates import model_with_template
from tests.services import start_engine, start_frontend

CHATML = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LOOP = "{%- for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
# One template per scenario: jinja2 folds constant expressions when it compiles a template,
# so without bounds the bomb would go off at the first chat of any kind.
LOOPS_ON_ASK = f"{{%- if messages[-1]['content'] == 'attack' %}}{LOOP}{{% endif %}}" + CHATML
BOMB_ON_ASK = "{%- if messages[-1]['content'] == 'attack' %}{{ 'a' * 1500000000 }}{% endif %}" + CHATML
RECURSES_ON_ASK = (
    "{%- macro deeper(n) %}{{ deeper(n + 1) }}{% endmacro %}"
    "{%- if messages[-1]['content'] == 'attack' %}{{ deeper(0) }}{% endif %}" + CHATML
)


class TemplatePair:
    """An engine and a frontend (HTTP face on) serving the demo model with ``template``."""

    def __init__(self, model: Path, template: str) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="tandem-abuse-template-")
        served = model_with_template(model, Path(self._dir.name) / "model", template)
        self.engine = start_engine(served, "--num-kv-blocks", "1024")
        self.engine.wait_serving()
        self.frontend = start_frontend(self.engine.address, extra=("--http-port", "0"))

    def serving(self) -> TemplatePair:
        self.frontend.wait_serving()
        return self

    @property
    def http(self) -> str:
        info = read_ready_file(self.frontend.ready_file) or {}
        return f"http://127.0.0.1:{info.get('http_port')}"

    def stop(self) -> None:
        self.frontend.terminate(timeout=10)  # a frozen frontend is killed after 10 s
        self.engine.terminate()
        self._dir.cleanup()


def _chat(text: str, **kw) -> g.GenerateRequest:
    messages = g.ChatMessages(messages=[g.ChatMessage(role="user", content=text)])
    return g.GenerateRequest(messages=messages, sampling_params=g.SamplingParams(max_tokens=2), **kw)


async def _health(base: str) -> str:
    t0 = time.monotonic()
    try:
        async with httpx.AsyncClient() as client:
            answer = await client.get(base + "/health", timeout=5)
        return f"/health {answer.status_code} in {(time.monotonic() - t0) * 1e3:.0f} ms"
    except httpx.HTTPError:
        return f"/health no answer in {time.monotonic() - t0:.0f} s"


def _children_rss(pid: int) -> float:
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return 0.0
    return sum(rss_mib(int(c)) for c in children)


async def _attack(pair: TemplatePair, request: g.GenerateRequest) -> str:
    """The attack beside a victim stream, a victim chat and /health, with the frontend's RSS."""
    pid = pair.frontend.proc.pid
    rss0, peak, render_peak = rss_mib(pid), 0.0, 0.0
    async with (
        grpc.aio.insecure_channel(pair.frontend.address) as attacker,
        grpc.aio.insecure_channel(pair.frontend.address) as other,
    ):
        stub = generate_pb2_grpc.GenerateServiceStub(other)
        victim = Victim(stub)
        await asyncio.sleep(2)
        t0 = time.monotonic()
        attack = asyncio.ensure_future(
            outcome(generate_pb2_grpc.GenerateServiceStub(attacker).Generate(request, timeout=20))
        )
        await asyncio.sleep(0.3)
        health = await _health(pair.http)
        chat_code, chat_s = await outcome(stub.Generate(_chat("hello"), timeout=10))
        while not attack.done():
            peak, render_peak = max(peak, rss_mib(pid)), max(render_peak, _children_rss(pid))
            await asyncio.sleep(0.05)
        code, seconds = await attack
        t1 = time.monotonic()
        await victim.stop()
    before, beside = victim.worst_gap(t0 - 2, t0), victim.worst_gap(t0, t1)
    render = f", render processes {render_peak:.0f} MiB" if render_peak else ""
    return (
        f"attack {code} in {seconds:.1f} s; beside it: victim chat {chat_code} in {chat_s * 1e3:.0f} ms, {health}, "
        f"victim stream's worst gap {beside * 1e3:.0f} ms ({before * 1e3:.0f} ms in the 2 s before); "
        f"frontend RSS {rss0:.0f} -> {max(peak, rss0):.0f} MiB{render}"
    )


async def _with_pair(template: str, work) -> str:
    from engine_svc.demo_model import ensure_demo_model

    pair = await asyncio.to_thread(lambda: TemplatePair(ensure_demo_model(), template).serving())
    try:
        return await work(pair)
    finally:
        await asyncio.to_thread(pair.stop)


async def template_loop(_pair, _stub) -> str:
    return await _with_pair(LOOPS_ON_ASK, lambda p: _attack(p, _chat("attack")))


async def template_bomb(_pair, _stub) -> str:
    return await _with_pair(BOMB_ON_ASK, lambda p: _attack(p, _chat("attack")))


async def template_recursion(_pair, _stub) -> str:
    async def work(pair: TemplatePair) -> str:
        async with grpc.aio.insecure_channel(pair.frontend.address) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            macro, macro_s = await outcome(stub.Generate(_chat("attack"), timeout=20))
            deep = '{"type": "object", "properties": {"x": ' * 500 + "{}" + "}}" * 500
            tools, tools_s = await outcome(
                stub.Generate(_chat("hi", tools=[g.Tool(name="f", parameters=deep)]), timeout=20)
            )
        return f"recursive macro: {macro} in {macro_s:.2f} s; tool parameters 1,000 deep: {tools} in {tools_s:.2f} s"

    return await _with_pair(RECURSES_ON_ASK, work)


async def template_start(_pair, _stub) -> str:
    from engine_svc.demo_model import ensure_demo_model

    pair = await asyncio.to_thread(TemplatePair, ensure_demo_model(), LOOP + CHATML)
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 15:
            state = (read_ready_file(pair.frontend.ready_file) or {}).get("state")
            if state == "serving" or "did not finish" in pair.frontend.log():
                break
            await asyncio.sleep(0.1)
        said = next((line for line in pair.frontend.log().splitlines() if "did not finish" in line), None)
        if state == "serving":
            status = "SERVING (the template is first run by a chat request)"
        else:
            status = f"not serving; the log says ...{said[-150:]}" if said else f"state {state}"
        return f"after {time.monotonic() - t0:.1f} s: {status}"
    finally:
        await asyncio.to_thread(pair.stop)


SCENARIOS = {
    "template-loop": template_loop,
    "template-bomb": template_bomb,
    "template-recursion": template_recursion,
    "template-start": template_start,
}
