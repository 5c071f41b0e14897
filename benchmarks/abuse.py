"""What cheap abusive requests and engine faults cost a running pair: one figure per scenario.

    python -m benchmarks.abuse                       # every scenario, demo model
    python -m benchmarks.abuse --scenario parked --scenario hung-engine

Each scenario starts its own engine and frontend (tests/services.py: subprocesses on
127.0.0.1, free ports) and stops them. The client side uses only the public API, so the
same file run from an older checkout (copied into its benchmarks/) measures the code
before a change: compare the two outputs. Scenarios:

    stop-token-ids  n = 16 with ~1 MiB of stop_token_ids: another stream's messages/s
    stop-strings    16 stop strings of 5000 characters: frontend memory, another stream's gaps
    huge-prompt     three 1.6 MB text prompts at once: time to the answer, frontend memory
    parked          N clients that read nothing: frontend memory per stream, engine still running
    hung-engine     the engine is stopped (SIGSTOP) mid-stream: seconds until the call ends
    slow-reader     the engine is killed while a slow reader's output waits: seconds to the end
    nested-schema, regex-bomb, bomb-memory, cancelled-compiles: structured output (abuse_structured.py)
    spec-bf16       speculation in bfloat16 with every request preempted: outputs changed (abuse_spec.py)

and those of benchmarks/abuse_frontend.py (prefix-flood, black-hole, fair-share,
metrics-flood, chat-role, stale-ready), benchmarks/abuse_engine_input.py (adapter-regex,
adapter-nan, lora-fresh, gguf-*), benchmarks/abuse_template.py (template-loop,
template-bomb, template-recursion, template-start), benchmarks/abuse_ops.py
(dead-loop-shutdown) and benchmarks/abuse_http.py (slowloris-idle, slowloris-trickle,
unread-http-streams, unread-grpc-streams).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from pathlib import Path

import grpc

from benchmarks.abuse_kit import BIG, SMALL_WINDOW, Victim, outcome, req, rss_mib
from benchmarks.abuse_spec import SCENARIOS as SPEC_SCENARIOS
from benchmarks.abuse_structured import SCENARIOS as STRUCTURED_SCENARIOS
from tandem_protos.tandem.generate.v1 import generate_pb2_grpc
from tests.rpc.frontend_calls import engine_load
from tests.services import start_engine, start_frontend


class Pair:
    def __init__(self, model: Path, frontend_args: tuple[str, ...], engine_args: tuple[str, ...] = ()) -> None:
        self.model = model  # for scenarios that start services of their own
        self.engine = start_engine(model, "--num-kv-blocks", "4096", "--max-num-seqs", "256", *engine_args)
        self.engine.wait_serving()
        self.frontend = start_frontend(self.engine.address, extra=frontend_args).wait_serving()

    def stop(self) -> None:
        self.frontend.terminate()
        if self.engine.proc.poll() is None:
            self.engine.proc.send_signal(signal.SIGCONT)
        self.engine.terminate()


async def stop_token_ids(pair: Pair, stub) -> str:
    victim = Victim(stub)
    await asyncio.sleep(3)
    t0 = time.monotonic()
    attack = asyncio.ensure_future(
        outcome(stub.Generate(req("attack", max_tokens=200, n=16, stop_token_ids=[1000] * 262_144), timeout=60))
    )
    await asyncio.sleep(8)
    t1 = time.monotonic()
    attack.cancel()
    code = (await attack)[0] if attack.done() and not attack.cancelled() else "still running"
    await victim.stop()
    return (
        f"victim {victim.rate(t0 - 3, t0):.0f} msg/s before, {victim.rate(t0, t1):.0f} msg/s during the attack "
        f"(attack: {code})"
    )


async def stop_strings(pair: Pair, stub) -> str:
    victim = Victim(stub)
    await asyncio.sleep(2)
    rss0, t0 = rss_mib(pair.frontend.proc.pid), time.monotonic()
    stops = [f"{i:02d}" + "ab" * 2499 for i in range(16)]
    code, _ = await outcome(stub.Generate(req("attack", max_tokens=100, stop=stops), timeout=120))
    t1 = time.monotonic()
    peak = rss_mib(pair.frontend.proc.pid) - rss0
    await victim.stop()
    return f"attack {code}; frontend RSS +{peak:.0f} MiB; victim's worst gap {victim.worst_gap(t0, t1) * 1e3:.0f} ms"


async def huge_prompt(pair: Pair, stub) -> str:
    victim = Victim(stub)
    await asyncio.sleep(2)
    rss0, t0 = rss_mib(pair.frontend.proc.pid), time.monotonic()
    peak = 0.0
    calls = [asyncio.ensure_future(outcome(stub.Generate(req("a b " * 400_000), timeout=300))) for _ in range(3)]
    while not all(c.done() for c in calls):
        peak = max(peak, rss_mib(pair.frontend.proc.pid) - rss0)
        await asyncio.sleep(0.05)
    t1 = time.monotonic()
    codes = sorted({c.result()[0] for c in calls})
    await victim.stop()
    return (
        f"3 x 1.6 MB prompts: {','.join(codes)} after {max(c.result()[1] for c in calls):.2f} s; frontend RSS "
        f"peak +{peak:.0f} MiB; victim's worst gap {victim.worst_gap(t0, t1) * 1e3:.0f} ms"
    )


async def parked(pair: Pair, stub, num: int = 100) -> str:
    channels = [grpc.aio.insecure_channel(pair.frontend.address, options=SMALL_WINDOW) for _ in range(num // 50 + 1)]
    rss0 = rss_mib(pair.frontend.proc.pid)
    stubs = [generate_pb2_grpc.GenerateServiceStub(c) for c in channels]
    calls = [stubs[i % len(stubs)].Generate(req(f"parked {i}", max_tokens=1500, logprobs=20)) for i in range(num)]
    await asyncio.gather(*(c.read() for c in calls))
    t0 = time.monotonic()
    figures = []
    for t in (5, 15, 45):  # the default --stalled-client-timeout-s is 30 s
        await asyncio.sleep(t0 + t - time.monotonic())
        per_stream = (rss_mib(pair.frontend.proc.pid) - rss0) * 1024 / num
        figures.append(f"t={t}s {per_stream:.0f} KiB/stream, engine running {await busy(pair)}")
    for c in calls:
        c.cancel()
    for c in channels:
        await c.close()
    return f"{num} parked streams: " + "; ".join(figures)


async def busy(pair: Pair) -> int:
    """Requests the engine is computing (its GetLoad)."""
    return (await engine_load(pair.engine.address)).num_running


async def hung_engine(pair: Pair, stub) -> str:
    call = stub.Generate(req("hung", max_tokens=1900))
    await call.read()
    pair.engine.proc.send_signal(signal.SIGSTOP)
    code, seconds = await outcome(call)
    return f"call ended {code} {seconds:.1f} s after the engine stopped"


async def slow_reader(pair: Pair, _stub) -> str:
    async with grpc.aio.insecure_channel(pair.frontend.address, options=SMALL_WINDOW) as channel:
        call = generate_pb2_grpc.GenerateServiceStub(channel).Generate(req("slow", max_tokens=1500, logprobs=20))
        await call.read()
        await asyncio.sleep(2)
        pair.engine.kill()
        t0 = time.monotonic()
        try:
            while True:
                response = await asyncio.wait_for(call.read(), 30)
                if response is grpc.aio.EOF:
                    return "ended OK"
                await asyncio.sleep(0.005)
        except grpc.aio.AioRpcError as e:
            return f"call ended {e.code().name} {time.monotonic() - t0:.2f} s after the kill"
        except asyncio.TimeoutError:
            return f"call still open {time.monotonic() - t0:.0f} s after the kill (given up)"


SCENARIOS = {
    "stop-token-ids": stop_token_ids,
    "stop-strings": stop_strings,
    "huge-prompt": huge_prompt,
    "parked": parked,
    "hung-engine": hung_engine,
    "slow-reader": slow_reader,
    **STRUCTURED_SCENARIOS,
    **SPEC_SCENARIOS,
}


async def run(names: list[str], model: Path, frontend_args: tuple[str, ...]) -> None:
    for name in names:
        pair = Pair(model, frontend_args)
        try:
            async with grpc.aio.insecure_channel(pair.frontend.address, options=BIG) as channel:
                result = await SCENARIOS[name](pair, generate_pb2_grpc.GenerateServiceStub(channel))
        finally:
            pair.stop()
        print(f"{name:16s} {result}", flush=True)


def main(argv: list[str] | None = None) -> None:
    from benchmarks.abuse_engine_input import SCENARIOS as ENGINE_INPUT_SCENARIOS
    from benchmarks.abuse_frontend import SCENARIOS as FRONTEND_SCENARIOS
    from benchmarks.abuse_http import SCENARIOS as HTTP_SCENARIOS
    from benchmarks.abuse_ops import SCENARIOS as OPS_SCENARIOS
    from benchmarks.abuse_template import SCENARIOS as TEMPLATE_SCENARIOS

    for more in (FRONTEND_SCENARIOS, ENGINE_INPUT_SCENARIOS, TEMPLATE_SCENARIOS, OPS_SCENARIOS, HTTP_SCENARIOS):
        SCENARIOS.update(more)
    p = argparse.ArgumentParser(prog="benchmarks.abuse", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), help="repeatable; default: all")
    p.add_argument("--model", default=None, help="model directory (default: the demo model)")
    p.add_argument(
        "--frontend-arg", action="append", default=[], help='frontend flags, e.g. --frontend-arg="--max-n 4"'
    )
    args = p.parse_args(argv)
    if args.model is None:
        from engine_svc.demo_model import ensure_demo_model

        model = ensure_demo_model()
    else:
        model = Path(args.model)
    asyncio.run(run(args.scenario or list(SCENARIOS), model, tuple(a for f in args.frontend_arg for a in f.split())))


if __name__ == "__main__":
    main()
