"""Speculative decoding: output tokens/s with and without drafts, by concurrency.

    python -m benchmarks.spec [--model GGUF_OR_DIR] [--concurrency 1 4 16 64]
        [--speculative-config JSON] [--quantization Q] [--num-requests N] [--repeats R] [--json OUT]

For each workload (``copy_heavy``: rewrite, extract, quote, repeat and continue-the-code
tasks; ``open_chat``: the control; both in benchmarks/workloads/, written by
``benchmarks.spec_workloads``) and each concurrency c, the engine runs in-process with
speculation off and on (two engines, built once), with exactly c requests in flight
(closed loop: a finished request is replaced at once) until ``max(c, --num-requests)``
are done, after an untimed warm-up run per workload; ``--repeats`` runs per arm,
alternating which arm goes first. Greedy, chat template applied, each request its own
max_tokens and EOS. Figures: the median output tokens/s of each arm, the ratio of the
medians (and each repetition's; and of output tokens per CPU-second, which other work on
a shared machine cannot take away), acceptance rate and mean accepted length of the
speculative arm over its runs, the load average.
The model defaults to the SmolLM2-135M-Instruct GGUF where it is cached, else the random
demo model (say which one when you quote the figures).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.workloads import HERE, load

SMOLLM2 = Path.home() / ".cache" / "tandem" / "smollm2-135m-instruct-v1" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'


def build_core(model: str | None, spec_json: str | None, max_num_seqs: int, dtype: str, quantization: str = "auto"):
    from engine_svc.config import EngineConfig
    from engine_svc.core import EngineCore
    from engine_svc.sched.spec import SpeculativeConfig

    spec = None if spec_json is None else SpeculativeConfig.from_json(spec_json)
    core = EngineCore(
        EngineConfig(
            model=model,
            dtype=dtype,
            quantization=quantization,
            max_num_seqs=max_num_seqs,
            speculative_config=spec,
            max_waiting=4096,
        )
    )
    core.warmup()
    return core


def prompts_of(core, workload: list[dict]) -> list[tuple[list[int], int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(core.model_dir))
    out = []
    for r in workload:
        if tokenizer.chat_template:
            ids = tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = tokenizer.encode(r["messages"][-1]["content"])
        out.append(([t for t in ids if t < core.vocab_size], r["max_tokens"]))
    return out


def closed_loop(core, prompts: list[tuple[list[int], int]], concurrency: int, num_requests: int) -> dict:
    """Run ``num_requests`` (cycling through ``prompts``) with ``concurrency`` in flight."""
    from engine_svc.types import SamplingParams

    counter = iter(range(num_requests))
    num_output = num_done = 0
    in_flight = 0

    def add() -> None:
        nonlocal in_flight
        i = next(counter, None)
        if i is None:
            return
        ids, max_tokens = prompts[i % len(prompts)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        core.add_request(core.make_request(f"bench-{concurrency}-{i}-{time.monotonic_ns()}", ids, params))
        in_flight += 1

    for _ in range(concurrency):
        add()
    t0, cpu0 = time.perf_counter(), time.process_time()
    while in_flight:
        for out in core.step():
            num_output += len(out.new_token_ids)
            if out.finished:
                in_flight -= 1
                num_done += 1
                add()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {
        "output_tok_per_s": num_output / wall,
        "output_tok_per_cpu_s": num_output / cpu,
        "num_output_tokens": num_output,
        "wall_s": wall,
        "cpu_s": cpu,
    }


def measure_arm(core, prompts, concurrency: int, num_requests: int) -> dict:
    """One timed run of one arm, with the speculation figures it added (if any)."""
    speculator = core.scheduler.speculator
    before = speculator.snapshot()  # None: speculative decoding is off
    result = closed_loop(core, prompts, concurrency, num_requests)
    if before is not None:
        after = speculator.snapshot()
        result["num_draft_tokens"] = after.num_draft_tokens - before.num_draft_tokens
        result["num_accepted_tokens"] = after.num_accepted_tokens - before.num_accepted_tokens
        result["num_verifications"] = after.num_drafts - before.num_drafts
    return result


def summarise(point: dict) -> None:
    """Medians over the repetitions, the ratio of the medians, and acceptance over all of them."""
    for arm in ("off", "on"):
        point[f"{arm}_tok_per_s"] = statistics.median(r["output_tok_per_s"] for r in point[arm])
        point[f"{arm}_tok_per_cpu_s"] = statistics.median(r["output_tok_per_cpu_s"] for r in point[arm])
    point["speedup"] = point["on_tok_per_s"] / point["off_tok_per_s"]
    # Per CPU-second: what the machine's other work cannot take from a run (a check on
    # the wall-clock ratio, which it can).
    point["cpu_speedup"] = point["on_tok_per_cpu_s"] / point["off_tok_per_cpu_s"]
    point["speedups"] = [on["output_tok_per_s"] / off["output_tok_per_s"] for on, off in zip(point["on"], point["off"])]
    drafts = sum(r.get("num_draft_tokens", 0) for r in point["on"])
    accepted = sum(r.get("num_accepted_tokens", 0) for r in point["on"])
    verifications = sum(r.get("num_verifications", 0) for r in point["on"])
    point["acceptance_rate"] = accepted / drafts if drafts else 0.0
    point["mean_accepted_length"] = 1 + accepted / verifications if verifications else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(SMOLLM2) if SMOLLM2.exists() else None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default="auto", help="the target's weights, as the engine's --quantization")
    p.add_argument("--speculative-config", default=DEFAULT_SPEC)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--num-requests", type=int, default=8, help="at least this many requests per point")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per arm and point, alternating off and on")
    p.add_argument("--workloads", nargs="+", default=["copy_heavy", "open_chat"])
    p.add_argument("--max-tokens", type=int, default=None, help="override every request's max_tokens")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    max_seqs = max(args.concurrency)
    cores = {"off": build_core(args.model, None, max_seqs, args.dtype, args.quantization)}
    cores["on"] = build_core(args.model, args.speculative_config, max_seqs, args.dtype, args.quantization)
    print(
        f"model: {cores['off'].model_name} ({cores['off'].runner.matmuls}); spec: {args.speculative_config}", flush=True
    )
    print(f"cpu: {cpu_model()}, {os.cpu_count()} cores; load average {load_average()}", flush=True)
    speculator = cores["on"].scheduler.speculator
    for what, costs in (("step", speculator.step_costs), ("draft pass", speculator.draft_costs)):
        if costs:  # empty without the adaptive rule; the draft's only with a draft model
            table = " ".join(f"{n}:{1000 * t:.1f}" for n, t in costs.table().items())
            print(f"calibrated {what} ms by rows: {table}", flush=True)
    results = []
    for name in args.workloads:
        workload = load(HERE / f"{name}.jsonl")
        prompts = prompts_of(cores["off"], workload)
        if args.max_tokens is not None:
            prompts = [(ids, args.max_tokens) for ids, _ in prompts]
        for core in cores.values():  # untimed: the thread governor's first measurements, lazy set-up
            closed_loop(core, [(ids, 8) for ids, _ in prompts], 2, 2)
        for c in args.concurrency:
            n = max(c, args.num_requests)
            point: dict = {"workload": name, "concurrency": c, "num_requests": n, "off": [], "on": []}
            for rep in range(args.repeats):
                # Alternate which arm goes first, so that a drift in the machine's load
                # weighs on both alike.
                for arm in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                    point[arm].append(measure_arm(cores[arm], prompts, c, n))
            point["load_average"] = load_average()
            summarise(point)
            results.append(point)
            print(
                f"{name:10s} c={c:3d}  off {point['off_tok_per_s']:7.1f} tok/s  on {point['on_tok_per_s']:7.1f} tok/s  "
                f"x{point['speedup']:.2f} (runs {' '.join(f'{x:.2f}' for x in point['speedups'])}; "
                f"per CPU-s x{point['cpu_speedup']:.2f})  "
                f"acceptance {point['acceptance_rate']:.2f}  mean accepted length "
                f"{point['mean_accepted_length']:.2f}  load {point['load_average']}",
                flush=True,
            )
    if args.json is not None:
        learned = {  # the adaptive rule's cost estimates after the runs, ms by rows
            what: {n: round(1000 * t, 2) for n, t in costs.table().items()}
            for what, costs in (("step_ms", speculator.step_costs), ("draft_pass_ms", speculator.draft_costs))
        }
        out = {"model": cores["off"].model_name, "spec": args.speculative_config, "costs": learned, "results": results}
        args.json.write_text(json.dumps(out, indent=2))
    return 0


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    sys.exit(main())
