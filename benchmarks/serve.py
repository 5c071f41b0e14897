"""Online serving benchmark: load the frontend's Generate over gRPC, report latency and throughput.

    python -m benchmarks.serve --target HOST:PORT --workload benchmarks/workloads/chat.jsonl \\
        [--rate 1,2,4,inf] [--max-concurrency 64] [--json OUT.json] [--plot OUT.png]
    python -m benchmarks.serve --launch [--model DIR] [--engine-arg=--max-num-seqs=64] \\
        --synthetic --num-requests 32 --prompt-len 32:128 --output-len 16:64 --compare-inprocess
    python -m benchmarks.serve --launch --engines 2 --compare-routing --multi-prefix \\
        --rate 5 --arrivals uniform --engine-arg="--num-threads 1 --num-kv-blocks 160"

Each rate runs the whole workload: arrivals are Poisson at that rate, or evenly spaced
with ``--arrivals uniform`` (``inf``, the default, sends everything at once), at most
``--max-concurrency`` calls are open at a time (a request that arrives at the cap waits
for a slot; its latencies start when it is sent). Requests are greedy with ignore_eos, so
each streams exactly its max_tokens; prompts go as token ids.

Figures per rate (the JSON holds one entry per rate, the table one column):

* throughput: requests/s, output tokens/s, prompt+output tokens/s over the run's wall time;
* TTFT: send to the first streamed token; E2E: send to the last message;
* ITL: each gap between two streamed messages divided by the tokens the later one carries,
  counted once per token (so a message of 3 tokens after 30 ms gives three 10 ms samples);
  TPOT: (E2E - TTFT) / (output tokens - 1) per request;
* ``tokens_per_message``: output tokens over the streamed messages that carried tokens
  (1.0 while every token goes alone; more when the frontend coalesces);
* errors by gRPC status code;
* ``prefix_cache_hit_rate``: prompt tokens served from the engines' prefix caches (each
  call's usage.cached_tokens) over all prompt tokens of the calls that completed;
* ``frontend_cpu_us_per_token``: CPU time (user + system) the frontend process spent during
  the run divided by the output tokens streamed (needs ``--launch`` or ``--frontend-pid``;
  ``engine_cpu_us_per_token`` likewise with ``--engine-pid``);
* ``pair_over_inprocess`` (``--compare-inprocess``): output tokens/s of the run divided by
  that of the engine run in-process (``EngineCore.generate``, all requests at once, same
  engine flags); it is the cost of the two services and the network hops at ``inf``.

The saturation point is the lowest rate at which requests complete more slowly than they
arrive: completions per second over the completion span below ``SATURATION_FRACTION`` of
arrivals per second over the arrival span. Spans (first to last) rather than the run's
wall time keep the drain of the last requests from looking like saturation.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from benchmarks.workloads import fit_context, fit_vocab, load, multi_prefix, salted, synthetic
from tandem_protos.tandem.generate.v1 import generate_pb2, generate_pb2_grpc

SATURATION_FRACTION = 0.8
PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """What one Generate call did; times in seconds on the benchmark's perf_counter clock."""

    arrival: float  # when the arrival process released it
    sent: float  # when it got a concurrency slot and was sent
    num_prompt_tokens: int
    code: str = "OK"  # grpc.StatusCode name
    ttft: float | None = None
    done: float | None = None
    num_output_tokens: int = 0
    num_messages: int = 0  # streamed messages that carried tokens
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage)
    itl: list[float] = field(default_factory=list)  # one sample per token after the first message

    @property
    def e2e(self) -> float | None:
        return None if self.done is None else self.done - self.sent

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.done is None or self.num_output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.num_output_tokens - 1)


# -- load generation --------------------------------------------------------------------------


async def _generate(stub, request: dict, arrival: float, sent: float, timeout: float) -> RequestResult:
    result = RequestResult(arrival, sent, len(request["prompt_token_ids"]))
    message = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=request["prompt_token_ids"]),
        sampling_params=generate_pb2.SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, ignore_eos=True),
        return_token_ids=True,  # so every message says how many tokens it carries
    )
    last = None
    try:
        async for response in stub.Generate(message, timeout=timeout):
            now = time.perf_counter()
            k = len(response.token_ids)
            if k:
                if last is None:
                    result.ttft = now - sent
                else:
                    result.itl.extend([(now - last) / k] * k)
                last = now
                result.num_output_tokens += k
                result.num_messages += 1
            if response.HasField("usage"):
                result.num_cached_tokens = response.usage.cached_tokens
        result.done = time.perf_counter()
    except grpc.aio.AioRpcError as e:
        result.code = e.code().name
    return result


async def run_rate(
    stub,
    workload: list[dict],
    rate: float,
    *,
    max_concurrency: int | None,
    seed: int,
    timeout: float,
    progress: bool = True,
    arrivals: str = "poisson",
) -> tuple[list[RequestResult], float]:
    """Sends the workload at ``rate`` (inf: all at once), Poisson or evenly spaced (``uniform``)."""
    from tqdm import tqdm

    rng = random.Random(seed)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(
        total=len(workload), desc=f"rate {rate:g}", unit="req", file=sys.stderr, disable=not progress, leave=False
    )

    async def one(request: dict) -> RequestResult:
        arrival = time.perf_counter()
        async with slots if slots else contextlib.nullcontext():
            result = await _generate(stub, request, arrival, time.perf_counter(), timeout)
        bar.update(1)
        return result

    start = time.perf_counter()
    due = start  # arrival times are absolute, so late wake-ups do not add up
    tasks = []
    for i, request in enumerate(workload):
        if i and math.isfinite(rate):
            due += rng.expovariate(rate) if arrivals == "poisson" else 1.0 / rate
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
        tasks.append(asyncio.create_task(one(request)))
    results = await asyncio.gather(*tasks)
    bar.close()
    return results, time.perf_counter() - start


# -- figures ----------------------------------------------------------------------------------


def _stats(samples_s: list[float]) -> dict | None:
    """mean and percentiles in milliseconds; None when there are no samples."""
    if not samples_s:
        return None
    a = np.asarray(samples_s) * 1e3
    return {"mean": float(a.mean()), **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}}


def _span_rate(times: list[float]) -> float:
    """Events per second between the first and the last event (inf when they coincide)."""
    if len(times) < 2:
        return math.inf
    span = max(times) - min(times)
    return (len(times) - 1) / span if span > 0 else math.inf


def summarize(results: list[RequestResult], wall_s: float, rate: float) -> dict:
    ok = [r for r in results if r.code == "OK"]
    num_prompt = sum(r.num_prompt_tokens for r in ok)
    num_cached = sum(r.num_cached_tokens for r in ok)
    num_output = sum(r.num_output_tokens for r in results)  # everything the frontend streamed
    arrival_rate = _span_rate([r.arrival for r in results]) if math.isfinite(rate) else math.inf
    completion_rate = _span_rate([r.done for r in ok])
    return {
        "rate": rate,
        "num_requests": len(results),
        "num_completed": len(ok),
        "errors": dict(Counter(r.code for r in results if r.code != "OK")),
        "wall_s": wall_s,
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_output,
        "num_cached_tokens": num_cached,
        "prefix_cache_hit_rate": num_cached / num_prompt if num_prompt else 0.0,
        "tokens_per_message": num_output / max(sum(r.num_messages for r in results), 1),
        "req_per_s": len(ok) / wall_s,
        "output_tok_per_s": num_output / wall_s,
        "total_tok_per_s": (num_prompt + num_output) / wall_s,
        "arrival_req_per_s": arrival_rate,
        "completion_req_per_s": completion_rate,
        "saturated": completion_rate < SATURATION_FRACTION * arrival_rate,
        "ttft_ms": _stats([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "tpot_ms": _stats([r.tpot for r in ok if r.tpot is not None]),
        "e2e_ms": _stats([r.e2e for r in ok]),
    }


def saturation_rate(entries: list[dict]) -> float | None:
    """The lowest finite swept rate found saturated, or None."""
    hits = [e["rate"] for e in entries if math.isfinite(e["rate"]) and e["saturated"]]
    return min(hits) if hits else None


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (psutil, or Linux /proc without it)."""
    try:
        import psutil
    except ImportError:
        fields_ = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


# -- the run ---------------------------------------------------------------------------------


def build_workload(args, info) -> tuple[list[dict], str]:
    if args.multi_prefix:
        workload = multi_prefix(
            args.seed,
            num_prefixes=args.num_prefixes,
            prefix_len=args.prefix_len,
            requests_per_prefix=args.requests_per_prefix,
            suffix_len=args.suffix_len,
            output_len=args.output_len,
            vocab_size=info.vocab_size,
        )
        name = (
            f"multi-prefix {args.num_prefixes} prompts x {args.prefix_len} tokens, {args.requests_per_prefix} "
            f"requests each (+{args.suffix_len[0]}:{args.suffix_len[1]}, output "
            f"{args.output_len[0]}:{args.output_len[1]}), interleaved, seed={args.seed}"
        )
    elif args.synthetic:
        workload = synthetic(
            args.seed,
            num_requests=args.num_requests,
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            vocab_size=info.vocab_size,
        )
        name = (
            f"synthetic n={args.num_requests} prompt={args.prompt_len[0]}:{args.prompt_len[1]} "
            f"output={args.output_len[0]}:{args.output_len[1]} seed={args.seed}"
        )
    else:
        workload = load(args.workload)[: args.num_requests or None]
        name = args.workload
    workload, folded = fit_vocab(workload, info.vocab_size)
    if folded:
        print(f"note: {folded} prompt ids >= vocab size {info.vocab_size} folded into range", file=sys.stderr)
    workload, trimmed = fit_context(workload, info.max_model_len)
    if trimmed:
        print(f"note: {trimmed} requests trimmed to max_model_len {info.max_model_len}", file=sys.stderr)
    return workload, name


async def drive(args, target: str, frontend_pid: int | None, engine_pid: int | None, on_rate=None) -> dict:
    """Runs every rate against ``target``; ``on_rate(i, "start" | "end")`` brackets each timed run."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        info = await stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=30)
        workload, name = build_workload(args, info)
        vocab = info.vocab_size
        if args.warmup:  # first calls pay for lazy set-up on both services
            warm = [{**r, "max_tokens": 2} for r in salted(workload, vocab - 1, vocab)[: args.warmup]]
            await run_rate(stub, warm, math.inf, max_concurrency=None, seed=0, timeout=args.timeout, progress=False)
        entries = []
        for i, rate in enumerate(args.rate):
            cpu0 = {pid: process_cpu_s(pid) for pid in (frontend_pid, engine_pid) if pid}
            if on_rate is not None:
                on_rate(i, "start")
            # Each rate gets its own salt, so no run is served from blocks an earlier run cached.
            results, wall = await run_rate(
                stub,
                salted(workload, i, vocab),
                rate,
                max_concurrency=args.max_concurrency,
                seed=args.seed,
                timeout=args.timeout,
                arrivals=args.arrivals,
            )
            if on_rate is not None:
                on_rate(i, "end")
            entry = summarize(results, wall, rate)
            for key, pid in (("frontend", frontend_pid), ("engine", engine_pid)):
                if pid:
                    cpu = process_cpu_s(pid) - cpu0[pid]
                    entry[f"{key}_cpu_s"] = cpu
                    entry[f"{key}_cpu_us_per_token"] = cpu * 1e6 / max(entry["num_output_tokens"], 1)
            entries.append(entry)
            entry["_results"] = results
    return {
        "model": info.model_name,
        "target": target,
        "workload": name,
        "num_requests": len(workload),
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "results": entries,
        "_workload": workload,
        "_vocab_size": vocab,
    }


def _rates(text: str) -> list[float]:
    rates = [math.inf if r.strip() in ("inf", "all") else float(r) for r in text.split(",")]
    if any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError("rates must be positive (or inf)")
    return rates


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"want MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", metavar="HOST:PORT", help="a running frontend")
    where.add_argument("--launch", action="store_true", help="start an engine and a frontend here, stop them after")
    p.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="model of --launch and --compare-inprocess (default: the demo model)",
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARGS",
        help="engine flags, e.g. --engine-arg=--max-num-seqs=64 (repeatable, shell-split)",
    )
    p.add_argument("--frontend-arg", action="append", default=[], metavar="ARGS", help="frontend flags (repeatable)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--workload", metavar="FILE", help="JSON lines of {prompt_token_ids, max_tokens}")
    src.add_argument("--synthetic", action="store_true", help="random prompt ids within the served vocabulary")
    src.add_argument(
        "--multi-prefix",
        action="store_true",
        help="requests behind a few system prompts, interleaved (workloads.multi_prefix; see --num-prefixes)",
    )
    p.add_argument("--num-prefixes", type=int, default=8, help="--multi-prefix: distinct system prompts (default: 8)")
    p.add_argument(
        "--prefix-len", type=int, default=512, help="--multi-prefix: tokens per system prompt (default: 512)"
    )
    p.add_argument(
        "--requests-per-prefix", type=int, default=16, help="--multi-prefix: requests per system prompt (default: 16)"
    )
    p.add_argument(
        "--suffix-len",
        type=_range,
        default=(8, 24),
        metavar="MIN:MAX",
        help="--multi-prefix: each request's own tokens after its system prompt (default: 8:24)",
    )
    p.add_argument(
        "--num-requests", type=int, default=0, help="--synthetic: how many; --workload: the first N (default: all)"
    )
    p.add_argument(
        "--prompt-len",
        type=_range,
        default=(32, 256),
        metavar="MIN:MAX",
        help="--synthetic prompt tokens, uniform (default: 32:256)",
    )
    p.add_argument(
        "--output-len",
        type=_range,
        default=None,
        metavar="MIN:MAX",
        help="--synthetic / --multi-prefix max_tokens, uniform (default: 16:128 / 16:32)",
    )
    p.add_argument(
        "--rate",
        type=_rates,
        default=[math.inf],
        metavar="R[,R2,...]",
        help="requests/s of the Poisson arrivals, one run per rate; inf = all at once (default: inf)",
    )
    p.add_argument(
        "--arrivals",
        choices=["poisson", "uniform"],
        default="poisson",
        help="arrival process at a finite rate: Poisson, or evenly spaced at exactly the rate (default: poisson)",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="most calls open at once (default: no cap)")
    p.add_argument("--seed", type=int, default=0, help="seeds the arrivals and the synthetic workload (default: 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of each call in seconds (default: 600)")
    p.add_argument("--warmup", type=int, default=1, help="short untimed calls before the first rate (default: 1)")
    p.add_argument("--frontend-pid", type=int, default=None, help="measure this local frontend's CPU time")
    p.add_argument("--engine-pid", type=int, default=None, help="measure this local engine's CPU time")
    p.add_argument(
        "--compare-inprocess",
        action="store_true",
        help="also run the workload on the engine in this process (same --model / --engine-arg)",
    )
    p.add_argument("--engines", type=int, default=1, help="--launch: engines behind the one frontend (default: 1)")
    p.add_argument(
        "--compare-routing",
        action="store_true",
        help="--launch: run the workload with --routing least-load, then with --routing prefix, each on "
        "freshly started engines and frontend, and report hit rate, TTFT, throughput and prediction "
        "agreement side by side (one rate; see serve_routing.py)",
    )
    p.add_argument("--json", default=None, metavar="OUT", help="write the figures here")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="latency against rate (or CDFs for one rate)")
    args = p.parse_args(argv)
    if args.synthetic and args.num_requests < 1:
        p.error("--synthetic needs --num-requests N")
    if args.output_len is None:
        args.output_len = (16, 32) if args.multi_prefix else (16, 128)
    if args.compare_routing and (not args.launch or args.engines < 2 or len(args.rate) != 1):
        p.error("--compare-routing needs --launch, --engines 2 or more and exactly one --rate")
    if args.engines > 1 and not args.launch:
        p.error("--engines needs --launch")
    return args


def main(argv: list[str] | None = None) -> int:
    from benchmarks.serve_report import format_table, jsonable, plot

    args = parse_args(argv)
    if args.compare_routing:
        from benchmarks.serve_routing import compare_routing

        return compare_routing(args)
    if args.launch:
        from benchmarks.serve_launch import launched

        with launched(args) as (engines, frontend):
            engine_pid = engines[0].proc.pid if len(engines) == 1 else None  # per-engine figure
            report = asyncio.run(drive(args, frontend.address, frontend.proc.pid, engine_pid))
    else:
        report = asyncio.run(drive(args, args.target, args.frontend_pid, args.engine_pid))
    if args.compare_inprocess:  # after the pair is stopped, so they do not share the CPUs
        from benchmarks.serve_launch import run_inprocess

        report["inprocess"] = run_inprocess(args, report["_workload"], report["_vocab_size"])
        for entry in report["results"]:
            entry["pair_over_inprocess"] = entry["output_tok_per_s"] / report["inprocess"]["output_tok_per_s"]
    report["saturation_rate"] = saturation_rate(report["results"])
    print(format_table(report))
    if args.plot:
        plot(report, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(jsonable(report), indent=2) + "\n")
        print(f"json: {args.json}")
    return 0 if all(not e["errors"] for e in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
