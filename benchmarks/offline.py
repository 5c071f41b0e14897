"""Offline throughput: the engine in-process (and over gRPC) against transformers.

    python -m benchmarks.offline --model DIR --workload benchmarks/workloads/standard.jsonl \
        [--json OUT] [--dtype float32|bfloat16] [--baseline hf|none] [--via-grpc]
        [--constraint json_schema:benchmarks/schemas/order.json]

All requests arrive at once, greedy, ignore_eos, each with its own max_tokens. The
baseline is ``transformers`` static batching (left-padded batches of 1, 8 and 16, each
batch generating up to its longest request; only each request's own tokens count).
``--constraint`` adds structured output's figures (``benchmarks/structured.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.workloads import load


def _totals(workload: list[dict]) -> tuple[int, int]:
    return sum(len(r["prompt_token_ids"]) for r in workload), sum(r["max_tokens"] for r in workload)


def _figures(workload: list[dict], wall_s: float, startup_s: float | None = None) -> dict:
    num_prompt, num_output = _totals(workload)
    out = {
        "output_tok_per_s": num_output / wall_s,
        "total_tok_per_s": (num_prompt + num_output) / wall_s,
        "wall_s": wall_s,
        "num_requests": len(workload),
        "num_output_tokens": num_output,
    }
    if startup_s is not None:
        out["startup_s"] = startup_s
    return out


def engine_args(args) -> list[str]:
    return [
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--kv-cache-bytes",
        str(args.kv_cache_bytes),
        "--quantization",
        args.quantization,
    ]


def run_engine(args, workload: list[dict]) -> dict:
    from engine_svc.config import EngineConfig, build_parser
    from engine_svc.core import EngineCore
    from engine_svc.types import SamplingParams

    t0 = time.perf_counter()
    core = EngineCore(EngineConfig.from_args(build_parser().parse_args(engine_args(args))))
    core.warmup()
    startup_s = time.perf_counter() - t0
    prompts = [r["prompt_token_ids"] for r in workload]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in workload]
    t0 = time.perf_counter()
    results = core.generate(prompts, params)
    wall = time.perf_counter() - t0
    assert all(len(c.output_token_ids) == r["max_tokens"] for c, r in zip(results, workload)), "short outputs"
    out = _figures(workload, wall, startup_s) | {"num_steps": core.num_steps}
    if args.constraint:
        from benchmarks import structured

        out["structured"] = structured.run(core, workload, structured.parse_constraint(args.constraint))
    return out


def run_engine_grpc(args, workload: list[dict]) -> dict:
    """The same workload through the engine service on loopback with a minimal client."""
    import grpc

    from tests.rpc.engine_stream import EngineStream
    from tests.services import start_engine

    t0 = time.perf_counter()
    proc = start_engine(args.model, *engine_args(args)[2:])
    try:
        proc.wait_serving(timeout=300)
        startup_s = time.perf_counter() - t0

        async def drive() -> float:
            async with grpc.aio.insecure_channel(proc.address) as channel:
                stream = EngineStream(channel)
                start = time.perf_counter()
                for i, r in enumerate(workload):
                    stream.add(
                        str(i), r["prompt_token_ids"], max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True
                    )
                await stream.wait(*map(str, range(len(workload))), timeout=3600)
                wall = time.perf_counter() - start
                short = [i for i, r in enumerate(workload) if len(stream.results[str(i)].token_ids) != r["max_tokens"]]
                assert not short, f"short outputs for {short}"
                stream.close()
                await stream.finished()
                return wall

        wall = asyncio.run(drive())
    finally:
        proc.terminate()
    return _figures(workload, wall, startup_s)


def run_hf(args, workload: list[dict], batch_size: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from engine_svc.model.load.loader import resolve_dtype

    dtype = resolve_dtype(args.dtype, args.device)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    subset = workload[: args.baseline_max_requests] if args.baseline_max_requests else workload
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(subset), batch_size):
            batch = subset[i : i + batch_size]
            width = max(len(r["prompt_token_ids"]) for r in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, r in enumerate(batch):
                p = r["prompt_token_ids"]
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            new = max(r["max_tokens"] for r in batch)
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
    return _figures(subset, time.perf_counter() - t0) | {"batch_size": batch_size}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--baseline", default="hf", choices=["hf", "none"])
    p.add_argument("--baseline-batch-sizes", default="1,8,16")
    p.add_argument(
        "--baseline-max-requests",
        type=int,
        default=0,
        help="run the baseline on the first N requests only (0 = all; it is slow)",
    )
    p.add_argument("--via-grpc", action="store_true", help="also run through the engine service on loopback")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--kv-cache-bytes", type=int, default=2 << 30)
    p.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8", "int4"],
        help="the engine's --quantization (auto: a GGUF's quantized tensors stay quantized)",
    )
    p.add_argument(
        "--constraint",
        default=None,
        metavar="KIND:FILE",
        help="also run the workload with every request constrained (json_schema, regex, grammar or choice "
        "read from FILE) against the same tokens unconstrained, and time the compile's first-token cost",
    )
    args = p.parse_args(argv)

    workload = load(args.workload)
    report: dict = {"model": args.model, "workload": args.workload, "dtype": args.dtype, "threads": os.cpu_count()}
    report["engine"] = run_engine(args, workload)
    print(f"engine      {json.dumps(report['engine'])}", flush=True)
    if "structured" in report["engine"]:
        s = report["engine"]["structured"]
        print(
            f"structured  {s['kind']}: {s['constrained_output_tok_per_s']:.1f} tok/s constrained, "
            f"{s['unconstrained_output_tok_per_s']:.1f} unconstrained, "
            f"ratio {s['constrained_over_unconstrained']:.3f}; "
            f"first token +{s.get('ttft_ms_added_cold_cache', float('nan')):.1f} ms cold, "
            f"+{s['ttft_ms_added_warm_cache']:.1f} ms warm",
            flush=True,
        )
    if args.via_grpc:
        report["engine_grpc"] = run_engine_grpc(args, workload)
        report["grpc_over_inprocess"] = report["engine_grpc"]["output_tok_per_s"] / report["engine"]["output_tok_per_s"]
        print(f"engine+grpc {json.dumps(report['engine_grpc'])}  ratio {report['grpc_over_inprocess']:.3f}", flush=True)
    if args.baseline == "hf":
        report["hf"] = {}
        for bs in [int(b) for b in args.baseline_batch_sizes.split(",")]:
            report["hf"][bs] = run_hf(args, workload, bs)
            print(f"hf bs={bs:<3}   {json.dumps(report['hf'][bs])}", flush=True)
        best = max(report["hf"].values(), key=lambda r: r["output_tok_per_s"])
        report["engine_over_best_hf"] = report["engine"]["output_tok_per_s"] / best["output_tok_per_s"]
        print(f"engine / best transformers (bs={best['batch_size']}): {report['engine_over_best_hf']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
