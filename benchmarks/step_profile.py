"""Where an engine step's time goes: achieved FLOP/s per step kind and a per-op table.

    python -m benchmarks.step_profile --model DIR --workload FILE [--dtype D] [--kernels K]
        [--max-requests N] [--max-num-batched-tokens N] [--engine-arg=--ARG=V ...] [--ops] [--json OUT]

Runs the workload in-process (all requests at once, greedy, ignore_eos) with a
``StepRecorder`` (benchmarks/flops.py) on the engine: steps with prefill rows and
decode-only steps, their time, rows and achieved GFLOP/s, next to the machine's matmul
peak measured in the same run. ``--ops`` also runs ``torch.profiler`` over a few steps of
each kind (the first prefill steps, and decode-only steps once every prompt is in) and
prints its per-op table for each, sorted by self CPU time; native kernel calls show as
``native::*`` rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.profiler

from benchmarks.flops import (
    ModelShape,
    StepRecorder,
    ceiling,
    decode_line,
    matmul_peak,
    memory_read_rate,
    workload_flops,
)
from benchmarks.workloads import load


def build_engine(model: str, dtype: str, kernels: str, max_num_seqs: int = 64, max_num_batched_tokens: int = 1024,
                 extra: tuple[str, ...] = ()):  # fmt: skip
    from engine_svc.config import EngineConfig, build_parser
    from engine_svc.core import EngineCore

    argv = ["--model", model, "--dtype", dtype, "--kernels", kernels, "--max-num-seqs", str(max_num_seqs),
            "--max-num-batched-tokens", str(max_num_batched_tokens), "--kv-cache-bytes", str(2 << 30),
            "--kv-cache-populate",
            *extra]  # fmt: skip
    t0 = time.perf_counter()
    core = EngineCore(EngineConfig.from_args(build_parser().parse_args(argv)))
    core.warmup()
    return core, time.perf_counter() - t0


def _label_native_kernels() -> None:
    """Make each native kernel call a row of the profiler's table (``native::gemm`` ...):
    ctypes calls are invisible to it otherwise."""
    import functools

    import torch.profiler

    from engine_svc.model.native import NativeKernels

    for name in (
        "gemm", "qgemm", "rms_norm", "silu_mul", "rope", "decode_attention", "prefill_attention", "decode_stack",
        "write_kv", "argmax_rows",
    ):  # fmt: skip
        fn = getattr(NativeKernels, name)

        @functools.wraps(fn)
        def labelled(*a, __fn=fn, __label=f"native::{name}", **kw):
            with torch.profiler.record_function(__label):
                return __fn(*a, **kw)

        setattr(NativeKernels, name, labelled)


def _op_table(prof, limit: int) -> str:
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=limit)


def run(args) -> dict:
    from engine_svc.types import SamplingParams

    workload = load(args.workload)[: args.max_requests or None]
    shape = ModelShape.from_model_dir(args.model)
    num_threads = torch.get_num_threads()
    core, startup_s = build_engine(
        args.model, args.dtype, args.kernels, max_num_batched_tokens=args.max_num_batched_tokens,
        extra=tuple(args.engine_arg),
    )  # fmt: skip
    recorder = StepRecorder(shape)
    recorder.attach(core)
    timed_step = core.step
    tables: dict[str, str] = {}
    if args.ops:
        _label_native_kernels()
        windows = {"prefill": (1, 4), "decode": None}  # decode: 3 steps from the first decode-only step

        def profiled_step():
            i = len(recorder.steps)
            kind = None
            if windows["prefill"] and windows["prefill"][0] <= i < windows["prefill"][1]:
                kind = "prefill"
            elif core.scheduler.num_waiting == 0 and not tables.get("decode") and _all_decoding(core):
                kind = "decode"
            if kind is None:
                return timed_step()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                out = timed_step()
                if kind == "decode":
                    for _ in range(2):
                        out += timed_step()
            tables[kind] = tables.get(kind, "") + _op_table(prof, args.op_rows)
            if kind == "prefill" and i + 1 >= windows["prefill"][1]:
                windows["prefill"] = None
            return out

        core.step = profiled_step

    prompts = [r["prompt_token_ids"] for r in workload]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in workload]
    t0 = time.perf_counter()
    core.generate(prompts, params)
    wall = time.perf_counter() - t0
    flops = workload_flops(shape, workload)
    torch.set_num_threads(num_threads)  # at every core: the engine's thread governor may have left fewer
    peak = matmul_peak(args.dtype, shape)
    memory = memory_read_rate()
    report = {
        "model": args.model,
        "workload": args.workload,
        "num_requests": len(workload),
        "dtype": args.dtype,
        "kernels": args.kernels,
        "startup_s": startup_s,
        "wall_s": wall,
        "output_tok_per_s": flops["num_output_tokens"] / wall,
        "flops": flops,
        "peak": peak,
        "ceiling": ceiling(flops, peak["gflops"]),
        "phases": recorder.summary(),
        "memory": memory,
        "kv_element_bytes": core.runner.kv_caches[0][0].element_size(),
        "weight_element_bytes": torch.empty((), dtype=core.runner.dtype).element_size(),
        "op_tables": tables,
    }
    report["ceiling_fraction"] = report["output_tok_per_s"] / report["ceiling"]["output_tok_per_s"]
    return report


def _all_decoding(core) -> bool:
    return all(r.num_computed_tokens >= r.num_prompt_tokens for r in core.scheduler.running)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kernels", default="auto")
    p.add_argument("--max-requests", type=int, default=0, help="the first N requests only (0 = all)")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=1024, help="tokens a step (vs_vllm's prefill-heavy cells: 4096)"
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        help="one more engine argument (repeatable), e.g. --engine-arg=--block-size=64",
    )
    p.add_argument("--ops", action="store_true", help="also print torch.profiler op tables")
    p.add_argument("--op-rows", type=int, default=25)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    report = run(args)
    for kind, table in report["op_tables"].items():
        print(f"== {kind} steps ==\n{table}")
    brief = {k: v for k, v in report.items() if k != "op_tables"}
    print(json.dumps(brief, indent=2))
    shape = ModelShape.from_model_dir(args.model)
    print(
        decode_line(
            report["phases"],
            shape,
            report["peak"]["gflops"],
            report["kv_element_bytes"],
            report["memory"]["gbps"],
            report["weight_element_bytes"],
        )
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
