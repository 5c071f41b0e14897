"""Load generation and figures of the online serving benchmark (benchmarks.serve): the
Generate calls at a rate, what each did, and the figures of one run per rate.

serve.py's docstring defines every figure; serve.py (the command line) and
serve_routing.py (least-load against prefix-aware routing) both drive runs from here.
"""

from __future__ import annotations

import asyncio
import contextlib
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
