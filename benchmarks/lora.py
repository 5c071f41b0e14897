"""What LoRA adapters cost: output tokens/s with 0, 1, 2, 4 and 8 distinct adapters against
the base model alone, one engine after the other in this process.

    python -m benchmarks.lora --model DIR [--workload benchmarks/workloads/standard.jsonl]
        [--adapters 0 1 2 4 8] [--rank 16] [--rounds 3] [--max-requests N] [--json OUT]

The base arm is an engine started without --enable-lora. The LoRA engine holds 8 adapters
(made with ``peft`` on the model: all seven targets at ``--rank``, B drawn at random so
each adapter changes the outputs) with --max-loras 8; arm N sends every request under one
of N adapters, round robin (N = 0: LoRA on, no request uses it: a step with no adapter
rows must cost nothing). All requests at once, greedy, ignore_eos, prefix caching off in
both engines (the rounds send the same prompts again). Arms alternate within each round,
after an untimed warm-up of each engine; medians over the rounds, and ratios to the base.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.vs_vllm import machine
from benchmarks.workloads import load
from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.lora_registry import LoraConfig
from engine_svc.types import SamplingParams

HERE = Path(__file__).resolve().parent


def build(model: str, dtype: str, adapters: dict[str, Path] | None, max_num_seqs: int) -> EngineCore:
    lora = LoraConfig(
        modules=tuple((n, str(p)) for n, p in (adapters or {}).items()),
        max_loras=max(1, len(adapters or {})),
        max_lora_rank=64,
    )
    config = EngineConfig(
        model=model,
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=1024,
        kv_cache_bytes=1 << 30,
        enable_prefix_caching=False,
        enable_lora=adapters is not None,
        lora=lora,
    )
    return EngineCore(config)


def timed(core: EngineCore, workload: list[dict], names: list[str | None]) -> dict:
    prompts = [r["prompt_token_ids"] for r in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in workload]
    t0, c0 = time.perf_counter(), time.process_time()
    results = core.generate(prompts, params, names)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    errors = [r.error for r in results if r.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    num_output = sum(len(r.output_token_ids) for r in results)
    return {
        "output_tok_per_s": num_output / wall,
        "output_tok_per_cpu_s": num_output / cpu,
        "wall_s": wall,
        "cpu_s": cpu,
        "num_output_tokens": num_output,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face directory (e.g. python -m benchmarks.make_model DIR)")
    p.add_argument("--workload", default=str(HERE / "workloads" / "standard.jsonl"))
    p.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 2, 4, 8], help="distinct adapters per arm")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-requests", type=int, default=None, help="the workload's first N requests")
    p.add_argument("--adapter-dir", type=Path, default=None, help="where the adapters are written (default: temp)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's); with 1, tokens per CPU-second "
        "measure the work alone, whatever else the machine runs",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from tests.lora_factory import make_adapter  # peft: a test dependency, needed here only

    workload = load(args.workload)[: args.max_requests]
    num_adapters = max(args.adapters)
    with tempfile.TemporaryDirectory(prefix="tandem-lora-bench-") as tmp:
        root = args.adapter_dir or Path(tmp)
        paths = {
            f"lora{i}": make_adapter(args.model, root / f"lora{i}", r=args.rank, alpha=2 * args.rank, seed=i)
            for i in range(max(num_adapters, 1))
        }
        engines = {"base": build(args.model, args.dtype, None, len(workload))}
        engines["lora"] = build(args.model, args.dtype, paths, len(workload))
    arms = {"base": ("base", [None] * len(workload))}
    for n in args.adapters:
        arms[f"{n} adapters"] = ("lora", [None if n == 0 else f"lora{i % n}" for i in range(len(workload))])
    for core in engines.values():  # untimed: lazy set-up, the thread governor's first figures
        core.generate([r["prompt_token_ids"][:64] for r in workload[:8]], SamplingParams(max_tokens=8, temperature=0))
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    info = machine()
    print(f"model {args.model}; {len(workload)} requests; rank {args.rank}; {info['cpu_model']} "
          f"({info['kernel_isa']} kernels), {info['torch_threads']} threads", flush=True)  # fmt: skip
    for r in range(args.rounds):
        for arm, (engine, names) in arms.items():
            run = timed(engines[engine], workload, names)
            run["load_average"] = os.getloadavg()
            runs[arm].append(run)
            print(
                f"round {r + 1} {arm:12s} {run['output_tok_per_s']:8.1f} output tok/s, "
                f"{run['output_tok_per_cpu_s']:8.1f} per CPU-second",
                flush=True,
            )
    summary: dict[str, dict] = {}
    for key in ("output_tok_per_s", "output_tok_per_cpu_s"):
        base = statistics.median(run[key] for run in runs["base"])
        print(f"-- {key}: median, and the ratio to the base model alone")
        for arm, arm_runs in runs.items():
            median = statistics.median(run[key] for run in arm_runs)
            summary.setdefault(arm, {"runs": arm_runs})[key] = {"median": median, "ratio_to_base": median / base}
            print(f"{arm:12s} {median:8.1f}  x{median / base:.3f} ({1 - median / base:+.1%} cost)")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"machine": info, "rank": args.rank, "workload": args.workload, "arms": summary}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
