"""The HTTP face against gRPC on a real model: one pair, the same streamed requests.

    python -m benchmarks.http_vs_grpc [--model PATH] [--concurrency 1 16] [--requests 16]
        [--prompt-len 32] [--max-tokens 64] [--repetitions 3] [--threads N] [--json OUT]

One engine (``--model``, default the demo model: SmolLM2-135M-Instruct) and one frontend
with the HTTP face. Per concurrency and repetition both faces run the same requests (token
id prompts, greedy, ``ignore_eos``, streamed), the order of the two alternating between
repetitions: gRPC ``Generate`` with ``return_token_ids`` and HTTP ``/v1/completions`` with
``stream_options.continuous_usage_stats``, so that each message or chunk says how many
tokens it carries. Per arm: output tokens/s and the inter-token latency (each message's
gap since the previous one of its request, spread evenly over its tokens) at the median
and p99. Prints medians over repetitions and HTTP / gRPC ratios.

What the pacing and coalescing cost on the saturating token engine is
``benchmarks.capacity --http``; this is the same comparison where the model sets the pace.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time

import grpc
import httpx

from benchmarks.vs_vllm import LoadSampler, machine


def requests_for(n: int, prompt_len: int, max_tokens: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(vocab // 2, vocab) for _ in range(prompt_len)], "max_tokens": max_tokens}
        for _ in range(n)
    ]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def _grpc_arm(address: str, requests: list[dict], concurrency: int) -> tuple[int, list[float]]:
    from tandem_protos.tandem.generate.v1 import generate_pb2, generate_pb2_grpc

    slots, gaps, counts = asyncio.Semaphore(concurrency), [], [0]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)

        async def one(r: dict) -> None:
            req = generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=r["prompt_token_ids"]),
                sampling_params=generate_pb2.SamplingParams(
                    max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True
                ),
                return_token_ids=True,
            )
            async with slots:
                last = None
                async for msg in stub.Generate(req):
                    now, n = time.perf_counter(), len(msg.token_ids)
                    if n and last is not None:
                        gaps.extend([(now - last) / n] * n)
                    if n:
                        last = now
                    counts[0] += n

        await asyncio.gather(*(one(r) for r in requests))
    return counts[0], gaps


async def _http_arm(base_url: str, requests: list[dict], concurrency: int) -> tuple[int, list[float]]:
    slots, gaps, counts = asyncio.Semaphore(concurrency), [], [0]
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=600) as client:

        async def one(r: dict) -> None:
            body = {
                "prompt": r["prompt_token_ids"], "max_tokens": r["max_tokens"], "temperature": 0.0,
                "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            }  # fmt: skip
            async with slots, client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
                last, seen = None, 0
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    now = time.perf_counter()
                    usage = json.loads(line[6:]).get("usage") or {}
                    n = int(usage.get("completion_tokens", seen)) - seen
                    if n > 0:
                        if last is not None:
                            gaps.extend([(now - last) / n] * n)
                        last, seen = now, seen + n
                counts[0] += seen

        await asyncio.gather(*(one(r) for r in requests))
    return counts[0], gaps


def run_arm(face: str, urls: dict, requests: list[dict], concurrency: int) -> dict:
    drive = _grpc_arm if face == "grpc" else _http_arm
    arm = drive(urls[face], requests, concurrency)
    with LoadSampler() as load:
        t0 = time.perf_counter()
        tokens, gaps = asyncio.run(arm)
        wall = time.perf_counter() - t0
    expected = sum(r["max_tokens"] for r in requests)
    if tokens != expected:
        raise RuntimeError(f"{face}: {tokens} output tokens, expected {expected}")
    return {
        "output_tok_per_s": tokens / wall,
        "itl_ms_median": 1e3 * statistics.median(gaps) if gaps else float("nan"),  # nan: one message each
        "itl_ms_p99": 1e3 * _percentile(gaps, 0.99),
        "loadavg": load.summary(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory or GGUF file (default: the demo model)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--requests", type=int, default=16, help="requests per arm (at least the concurrency)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="the engine's --num-threads")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from engine_svc.demo_checkpoint import ensure_demo_checkpoint
    from tandem_common.ready import read_ready_file
    from tests.services import start_engine, start_frontend

    model = args.model or str(ensure_demo_checkpoint())
    engine_argv = ["--num-threads", str(args.threads)] if args.threads else []
    engine = start_engine(model, *engine_argv)
    frontend = None
    report: dict = {"machine": machine(), "args": vars(args), "cells": {}}
    try:
        engine.wait_serving(timeout=600)
        frontend = start_frontend(engine.address, extra=("--http-port", "0", "--max-calls-per-client", "0"))
        frontend.wait_serving(timeout=120)
        urls = {
            "grpc": frontend.address,
            "http": f"http://127.0.0.1:{read_ready_file(frontend.ready_file)['http_port']}",
        }
        run_arm("grpc", urls, requests_for(2, 8, 8, 2000, 0), 2)  # warm-up of both faces
        run_arm("http", urls, requests_for(2, 8, 8, 2000, 0), 2)
        for c in args.concurrency:
            runs: dict[str, list[dict]] = {"grpc": [], "http": []}
            for rep in range(args.repetitions):
                reqs = requests_for(max(args.requests, c), args.prompt_len, args.max_tokens, 2000, seed=100 * c + rep)
                for face in ("grpc", "http") if rep % 2 == 0 else ("http", "grpc"):
                    runs[face].append(run_arm(face, urls, reqs, c))
            keys = ("output_tok_per_s", "itl_ms_median", "itl_ms_p99")
            cell = {face: {k: statistics.median(r[k] for r in rs) for k in keys} for face, rs in runs.items()}
            cell["ratio_tok_per_s"] = cell["http"]["output_tok_per_s"] / cell["grpc"]["output_tok_per_s"]
            cell["itl_p99_added_ms"] = cell["http"]["itl_ms_p99"] - cell["grpc"]["itl_ms_p99"]
            cell["runs"] = runs
            report["cells"][str(c)] = cell
            print(
                f"concurrency {c:3d}: gRPC {cell['grpc']['output_tok_per_s']:7.1f} tok/s, HTTP "
                f"{cell['http']['output_tok_per_s']:7.1f} ({cell['ratio_tok_per_s']:.2f}x); ITL median "
                f"{cell['grpc']['itl_ms_median']:.2f} / {cell['http']['itl_ms_median']:.2f} ms, p99 "
                f"{cell['grpc']['itl_ms_p99']:.2f} / {cell['http']['itl_ms_p99']:.2f} ms "
                f"(HTTP {cell['itl_p99_added_ms']:+.2f} ms)",
                flush=True,
            )
    finally:
        if frontend is not None:
            frontend.terminate()
        engine.terminate()
    print(f"model {model}; {report['machine']}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
