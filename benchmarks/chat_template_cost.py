"""What rendering chat templates in render processes costs an ordinary chat request.

    python -m benchmarks.chat_template_cost [--against DIR] [--rounds 15] [--calls 40] [--max-tokens 32]

Two parts:

* **render**: one ordinary conversation (system, user, assistant, user; and the same with
  a tool) rendered in this process, as the frontend used to on its event loop, and through
  the render processes (text/chat_template/renderer.py), as it does now: median µs each.
  The in-process figure is given for jinja2's plain sandbox and for ours with its bounds.
* **end to end**: one demo-model engine and this checkout's frontend; with ``--against
  DIR``, a frontend of that checkout too, on the same engine. Each round runs ``--calls``
  sequential chat Tokenize calls (the frontend's whole path for a chat, no engine) and
  chat Generate calls (``--max-tokens``, 32), on each frontend in turn, the order alternating; the
  median per round, then the median and range over rounds. Interleaving spreads the
  noise of a shared machine over both sides alike.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import jinja2.sandbox

from frontend_svc.text.chat_template.renderer import TemplateBudget, TemplateRenderer
from frontend_svc.text.chat_template.sandbox import ChatSandbox, template_variables
from tandem_common.ready import read_ready_file
from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tandem_protos.tandem.generate.v1 import generate_pb2_grpc
from tests.chat_templates import CHATML, HERMES_THINKING
from tests.services import start_engine

ROOT = Path(__file__).resolve().parent.parent
CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France? Answer in one word."},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Germany?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def _median_us(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t)
    return statistics.median(times) / 1e3


async def render_figures(n: int = 3000) -> list[str]:
    lines = []
    for name, template, variables in (("ChatML", CHATML, {}), ("hermes + 1 tool", HERMES_THINKING, {"tools": TOOLS})):
        values = template_variables({"bos_token": "<s>"}, CHAT, True, variables)
        plain = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        plain.filters["tojson"] = ChatSandbox()._tojson
        plain_t, ours_t = plain.from_string(template), ChatSandbox().from_string(template)
        renderer = TemplateRenderer(template, {"bos_token": "<s>"}, name, TemplateBudget())
        await renderer.start()
        try:
            times = []
            for _ in range(n):
                t = time.perf_counter_ns()
                await renderer.render(CHAT, True, variables)
                times.append(time.perf_counter_ns() - t)
        finally:
            await renderer.close()
        plain_us = _median_us(lambda t=plain_t, v=values: t.render(**v), n)
        ours_us = _median_us(lambda t=ours_t, v=values: t.render(**v), n)
        lines.append(
            f"render {name:16s} in process: jinja2 sandbox {plain_us:.1f} us, ours {ours_us:.1f} us; "
            f"render process {statistics.median(times) / 1e3:.1f} us (medians of {n})"
        )
    return lines


class Frontend:
    """A frontend of the checkout at ``root`` (its own code), on a free port."""

    def __init__(self, root: Path, engine: str) -> None:
        self.ready = Path(tempfile.mkdtemp(prefix="tandem-cost-")) / "ready.json"
        env = {**os.environ, "PYTHONPATH": str(root)}
        args = ["--engine", engine, "--host", "127.0.0.1", "--port", "0", "--ready-file", str(self.ready)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "frontend_svc", *args], cwd=root, env=env, stderr=subprocess.DEVNULL
        )

    def address(self) -> str:
        deadline = time.monotonic() + 120
        while (info := read_ready_file(self.ready)) is None or info["state"] != "serving":
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the frontend did not start")
            time.sleep(0.05)
        return f"127.0.0.1:{info['port']}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


async def _round(address: str, calls: int, max_tokens: int) -> tuple[float, float]:
    messages = g.ChatMessages(messages=[g.ChatMessage(role=m["role"], content=m["content"]) for m in CHAT])
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        tokenize, generate = [], []
        for _ in range(calls):
            t = time.perf_counter()
            await stub.Tokenize(g.TokenizeRequest(messages=messages), timeout=30)
            tokenize.append(time.perf_counter() - t)
        request = g.GenerateRequest(
            messages=messages, sampling_params=g.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        )
        for _ in range(calls):
            t = time.perf_counter()
            async for _ in stub.Generate(request, timeout=60):
                pass
            generate.append(time.perf_counter() - t)
    return statistics.median(tokenize) * 1e3, statistics.median(generate) * 1e3


async def end_to_end(sides: dict[str, str], rounds: int, calls: int, max_tokens: int) -> list[str]:
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    for _ in range(2):  # warm both
        for address in sides.values():
            await _round(address, 5, max_tokens)
    order = list(sides)
    for r in range(rounds):
        for name in order if r % 2 == 0 else reversed(order):
            figures[name].append(await _round(sides[name], calls, max_tokens))
    lines = []
    for name, rows in figures.items():
        tok, gen = [t for t, _ in rows], [x for _, x in rows]
        lines.append(
            f"{name:8s} chat Tokenize {statistics.median(tok):.3f} ms ({min(tok):.3f}-{max(tok):.3f}); "
            f"chat Generate ({max_tokens} tokens) {statistics.median(gen):.2f} ms ({min(gen):.2f}-{max(gen):.2f}); "
            f"medians of {rounds} rounds x {calls} calls (range of the round medians)"
        )
    if len(figures) == 2:
        (a, ra), (b, rb) = figures.items()
        ratio_tok = statistics.median(t for t, _ in ra) / statistics.median(t for t, _ in rb)
        ratio_gen = statistics.median(x for _, x in ra) / statistics.median(x for _, x in rb)
        lines.append(f"{a} / {b}: Tokenize {ratio_tok:.3f}, Generate {ratio_gen:.3f}")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="benchmarks.chat_template_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--against", default=None, metavar="DIR", help="another checkout whose frontend to compare")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=32, help="tokens each chat Generate call asks for")
    args = p.parse_args(argv)
    for line in asyncio.run(render_figures()):
        print(line, flush=True)
    from engine_svc.demo_model import ensure_demo_model

    engine = start_engine(ensure_demo_model(), "--num-kv-blocks", "512")
    frontends: dict[str, Frontend] = {}
    try:
        engine.wait_serving()
        frontends["this"] = Frontend(ROOT, engine.address)
        if args.against:
            frontends["against"] = Frontend(Path(args.against).resolve(), engine.address)
        sides = {name: f.address() for name, f in frontends.items()}
        print(f"load average {os.getloadavg()[0]:.2f} at the start", flush=True)
        for line in asyncio.run(end_to_end(sides, args.rounds, args.calls, args.max_tokens)):
            print(line, flush=True)
        print(f"load average {os.getloadavg()[0]:.2f} at the end", flush=True)
    finally:
        for f in frontends.values():
            f.stop()
        engine.terminate()


if __name__ == "__main__":
    main()
