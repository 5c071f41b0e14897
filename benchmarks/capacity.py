"""Frontend capacity: the tokens/s one frontend streams, its CPU per token and the latency it adds.

    python -m benchmarks.capacity [--calls 1,16,64,256] [--rates 250,500,...,32000]
        [--settings default,interval1,workers2] [--http] [--window-s 2] [--json OUT.json] [--plot OUT.png]

For each setting (``default``: adaptive coalescing; ``interval1``: ``--stream-interval 1``,
one message per token; ``workers2``: ``--workers 2``) it starts a token engine
(benchmarks.token_engine, no model) and a frontend over it, then for each number of
concurrent calls it keeps that many long calls streaming and steps the offered token rate
(calls x 1000 / the engine's step period in ms) through ``--rates``. Each point is measured
over ``--window-s`` seconds after a short settle:

* tokens/s the client received; tokens per message;
* frontend CPU per token: user + system seconds of the frontend process and its children
  (the workers), from /proc, over the tokens of the window;
* ITL as benchmarks.serve counts it (a message of k tokens after a gap g gives k samples
  of g/k), and the frontend-added ITL p99: ITL p99 minus the engine's step period; the
  message gap p99 too (the longest a token can have waited for its message);
* sustained: at least 90% of the offered rate arrived and the added ITL p99 is under 5 ms.

Per setting and number of calls, the capacity is the highest tokens/s of a sustained point.
With ``--http`` each setting runs a second time with the same calls streamed over the
frontend's OpenAI-compatible HTTP face (benchmarks.http_load), as ``SETTING+http``, and
the ratios compare the two faces.
The load client is this process (Python, on the same cores as the frontend and the engine;
benchmarks.http_load says how both loads keep their cost per message low).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from benchmarks.capacity_report import plot, print_report, ratios
from tandem_protos.tandem.generate.v1 import generate_pb2, generate_pb2_grpc

SETTINGS = {"default": (), "interval1": ("--stream-interval", "1"), "workers2": ("--workers", "2")}
ADDED_ITL_BUDGET_MS = 5.0
SUSTAINED_FRACTION = 0.9
SETTLE_S = 0.6  # after a rate change: the engine reads its step file every 0.2 s
MIN_STEP_MS = 1.0  # the token engine's shortest step: 1000 tokens/s per call at most
NUM_CONNECTIONS = 8  # the calls are spread over this many connections (workers get some each)


@dataclass
class _Call:
    times: list[float] = field(default_factory=list)  # arrival of each message with tokens, in the window
    sizes: list[int] = field(default_factory=list)  # its tokens


class Load:
    """``num_calls`` long Generate calls kept open over a few connections."""

    def __init__(self, target: str, num_calls: int) -> None:
        options = [("grpc.use_local_subchannel_pool", 1)]
        self.channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(NUM_CONNECTIONS)]
        self.calls = [_Call() for _ in range(num_calls)]
        self.recording = False
        self.errors: list[str] = []
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        for i, call in enumerate(self.calls):
            stub = generate_pb2_grpc.GenerateServiceStub(self.channels[i % len(self.channels)])
            self._tasks.append(asyncio.create_task(self._run(stub, call, i)))

    async def _run(self, stub, call: _Call, i: int) -> None:
        request = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=[1 + (i + j) % 500 for j in range(16)]),
            sampling_params=generate_pb2.SamplingParams(max_tokens=1 << 19, temperature=0.0, ignore_eos=True),
            return_token_ids=True,
        )
        while True:  # a call that ends (it should not) is replaced
            rpc = stub.Generate(request)
            try:
                # call.read() rather than ``async for``: the least work per message (as the HTTP load's)
                while (response := await rpc.read()) is not grpc.aio.EOF:
                    if self.recording:
                        k = len(response.token_ids)
                        if k:
                            call.times.append(time.perf_counter())
                            call.sizes.append(k)
            except grpc.aio.AioRpcError as e:
                if e.code() is grpc.StatusCode.CANCELLED:
                    return
                self.errors.append(e.code().name)
            except asyncio.CancelledError:
                rpc.cancel()
                return
            await asyncio.sleep(0.1)

    def reset(self) -> None:
        for call in self.calls:
            call.times.clear()
            call.sizes.clear()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for channel in self.channels:
            await channel.close()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live children."""
    import psutil

    process = psutil.Process(pid)
    total = 0.0
    for p in [process, *process.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def measure(load: Load, window_s: float, step_ms: float, offered: float, frontend_pid: int, engine_pid: int):
    """Figures of one window (called around ``await asyncio.sleep(window_s)``): a generator."""
    load.reset()
    cpu0, engine0, t0 = cpu_s(frontend_pid), cpu_s(engine_pid), time.perf_counter()
    client0 = time.process_time()
    load.recording = True
    yield
    load.recording = False
    wall, cpu, engine_cpu = time.perf_counter() - t0, cpu_s(frontend_pid) - cpu0, cpu_s(engine_pid) - engine0
    client_cpu = time.process_time() - client0
    num_tokens = sum(sum(c.sizes) for c in load.calls)
    num_messages = sum(len(c.sizes) for c in load.calls)
    itl, gaps = [], []
    for c in load.calls:
        t = np.asarray(c.times)
        if len(t) > 1:
            g = np.diff(t)
            k = np.asarray(c.sizes[1:])
            itl.append(np.repeat(g / k, k))
            gaps.append(g)
    itl_ms = np.concatenate(itl) * 1e3 if itl else np.asarray([np.nan])
    gap_ms = np.concatenate(gaps) * 1e3 if gaps else np.asarray([np.nan])
    tok_per_s = num_tokens / wall
    itl_p99 = float(np.percentile(itl_ms, 99))
    yield {
        "step_ms": step_ms,
        "offered_tok_per_s": offered,
        "tok_per_s": tok_per_s,
        "tokens_per_message": num_tokens / max(num_messages, 1),
        "frontend_cpu_us_per_token": cpu * 1e6 / max(num_tokens, 1),
        "frontend_cpu_s_per_s": cpu / wall,
        "engine_cpu_s_per_s": engine_cpu / wall,
        "client_cpu_s_per_s": client_cpu / wall,
        "load_average_1m": os.getloadavg()[0],
        "itl_mean_ms": float(np.mean(itl_ms)),
        "itl_p50_ms": float(np.percentile(itl_ms, 50)),
        "itl_p99_ms": itl_p99,
        "added_itl_p99_ms": itl_p99 - step_ms,
        "message_gap_p99_ms": float(np.percentile(gap_ms, 99)),
        "sustained": tok_per_s >= SUSTAINED_FRACTION * offered and itl_p99 - step_ms < ADDED_ITL_BUDGET_MS,
    }


async def run_setting(name: str, args, http: bool = False) -> dict:
    from benchmarks.http_load import HttpLoad
    from tandem_common.ready import read_ready_file
    from tests.services import ServiceProcess, start_frontend

    step_file = Path(tempfile.mkdtemp(prefix="tandem-capacity-")) / "step_ms"
    step_file.write_text("10")
    engine = ServiceProcess("benchmarks.token_engine", ["--step-ms", "10", "--step-ms-file", str(step_file)])
    frontend = None
    points: dict[str, list[dict]] = {}
    try:
        engine.wait_serving(60)
        extra = (*SETTINGS[name], "--http-port", "0") if http else SETTINGS[name]
        frontend = start_frontend(engine.address, extra=extra).wait_serving(60)
        http_port = (read_ready_file(frontend.ready_file) or {}).get("http_port")
        for num_calls in args.calls:
            steps = sorted({max(MIN_STEP_MS, num_calls * 1000.0 / rate) for rate in args.rates}, reverse=True)
            step_file.write_text(f"{steps[0]}")
            await asyncio.sleep(SETTLE_S)
            load = (
                HttpLoad(f"http://127.0.0.1:{http_port}", num_calls, _Call)
                if http
                else Load(frontend.address, num_calls)
            )
            await load.start()
            await asyncio.sleep(SETTLE_S)  # the calls start
            points[str(num_calls)] = []
            try:
                for step_ms in steps:
                    offered = num_calls * 1000.0 / step_ms
                    step_file.write_text(f"{step_ms}")
                    await asyncio.sleep(SETTLE_S)
                    window = measure(load, args.window_s, step_ms, offered, frontend.proc.pid, engine.proc.pid)
                    next(window)
                    await asyncio.sleep(args.window_s)
                    point = next(window)
                    point["errors"] = list(load.errors)
                    points[str(num_calls)].append(point)
                    label = name + "+http" if http else name
                    print(f"{label:>9} {num_calls:>4} calls {_line(point)}", file=sys.stderr, flush=True)
            finally:
                await load.close()
            await asyncio.sleep(0.5)  # the cancelled calls' aborts reach the engine
    finally:
        if frontend is not None:
            frontend.terminate()
        engine.terminate()
    late = re.findall(r"stopped after (\d+) steps, (\d+) of them late", engine.log())
    if late:  # late steps give several tokens per request in one engine output
        points["engine_steps"] = {"total": int(late[-1][0]), "late": int(late[-1][1])}
    return points


def _line(p: dict) -> str:
    return (
        f"offered {p['offered_tok_per_s']:>7.0f} got {p['tok_per_s']:>7.0f} tok/s  "
        f"{p['tokens_per_message']:.2f} tok/msg  {p['frontend_cpu_us_per_token']:>6.1f} us/tok  "
        f"ITL p99 {p['itl_p99_ms']:.2f} ms (+{p['added_itl_p99_ms']:.2f})  {'ok' if p['sustained'] else '--'}  "
        f"cores: frontend {p['frontend_cpu_s_per_s']:.2f} engine {p['engine_cpu_s_per_s']:.2f} "
        f"client {p['client_cpu_s_per_s']:.2f}"
    )


def capacity(points: list[dict]) -> dict | None:
    """The sustained point with the most tokens/s, or None."""
    ok = [p for p in points if p["sustained"]]
    return max(ok, key=lambda p: p["tok_per_s"]) if ok else None


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.capacity", description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=_ints, default=[1, 16, 64, 256], help="concurrent calls (default: 1,16,64,256)")
    p.add_argument(
        "--rates",
        type=_ints,
        default=[250, 500, 1000, 2000, 4000, 8000, 16000, 32000],
        help="offered tokens/s (default: 250 to 32000, doubling; at most 1000 per call)",
    )
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"some of {','.join(SETTINGS)}")
    p.add_argument(
        "--http", action="store_true", help="also run each setting over the HTTP face (SETTING+http) and compare"
    )
    p.add_argument("--window-s", type=float, default=2.0, help="seconds measured per point (default: 2)")
    p.add_argument("--json", default=None, metavar="OUT")
    p.add_argument("--plot", default=None, metavar="OUT.png")
    args = p.parse_args(argv)
    names = args.settings.split(",")
    unknown = set(names) - set(SETTINGS)
    if unknown:
        p.error(f"unknown settings {sorted(unknown)}; choose from {list(SETTINGS)}")
    started = time.time()
    load_before = os.getloadavg()
    results = {name: asyncio.run(run_setting(name, args)) for name in names}
    if args.http:
        results.update({name + "+http": asyncio.run(run_setting(name, args, http=True)) for name in names})
    report = {
        "cpu": _cpu_model(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "duration_s": time.time() - started,
        "settings": {name: " ".join(SETTINGS[name.removesuffix("+http")]) or "(defaults)" for name in results},
        "points": results,
        "engine_steps": {name: by_calls.pop("engine_steps", None) for name, by_calls in results.items()},
        "capacity": {
            name: {calls: capacity(points) for calls, points in by_calls.items()} for name, by_calls in results.items()
        },
    }
    report["ratios"] = ratios(report)
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"json: {args.json}")
    if args.plot:
        plot(report, args.plot)
        print(f"plot: {args.plot}")


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
