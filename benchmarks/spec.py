"""Speculative decoding: output tokens/s with and without drafts, by concurrency.

    python -m benchmarks.spec [--model GGUF_OR_DIR] [--concurrency 1 4 16 64]
        [--speculative-config JSON] [--num-requests N] [--json OUT]

For each workload (``copy_heavy``: rewrite, extract, quote, repeat and continue-the-code
tasks; ``open_chat``: the control; both in benchmarks/workloads/, written by
``benchmarks.spec_workloads``) and each concurrency c, the engine runs in-process twice,
speculation off and on, with exactly c requests in flight (closed loop: a finished
request is replaced at once) until ``max(c, --num-requests)`` are done, after an untimed
warm-up run per workload. Greedy, chat template applied, each request its own max_tokens
and EOS. Figures: output tokens/s of
each arm, their ratio, acceptance rate and mean accepted length of the speculative arm.
The model defaults to the SmolLM2-135M-Instruct GGUF where it is cached, else the random
demo model (say which one when you quote the figures).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from benchmarks.workloads import HERE, load

SMOLLM2 = Path.home() / ".cache" / "tandem" / "smollm2-135m-instruct-v1" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'


def build_core(model: str | None, spec_json: str | None, max_num_seqs: int, dtype: str):
    from engine_svc.config import EngineConfig
    from engine_svc.core import EngineCore
    from engine_svc.sched.spec import SpeculativeConfig

    spec = None if spec_json is None else SpeculativeConfig.from_json(spec_json)
    core = EngineCore(
        EngineConfig(model=model, dtype=dtype, max_num_seqs=max_num_seqs, speculative_config=spec, max_waiting=4096)
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
    t0 = time.perf_counter()
    while in_flight:
        for out in core.step():
            num_output += len(out.new_token_ids)
            if out.finished:
                in_flight -= 1
                num_done += 1
                add()
    wall = time.perf_counter() - t0
    return {"output_tok_per_s": num_output / wall, "num_output_tokens": num_output, "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(SMOLLM2) if SMOLLM2.exists() else None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--speculative-config", default=DEFAULT_SPEC)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--num-requests", type=int, default=8, help="at least this many requests per point")
    p.add_argument("--workloads", nargs="+", default=["copy_heavy", "open_chat"])
    p.add_argument("--max-tokens", type=int, default=None, help="override every request's max_tokens")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    max_seqs = max(args.concurrency)
    cores = {"off": build_core(args.model, None, max_seqs, args.dtype)}
    cores["on"] = build_core(args.model, args.speculative_config, max_seqs, args.dtype)
    print(f"model: {cores['off'].model_name}; cpu: {os.cpu_count()} cores; spec: {args.speculative_config}", flush=True)
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
            point: dict = {"workload": name, "concurrency": c, "num_requests": n}
            for arm, core in cores.items():
                before = core.scheduler.speculator.stats.snapshot() if core.scheduler.speculator else None
                point[arm] = closed_loop(core, prompts, c, n)
                if before is not None:
                    after = core.scheduler.speculator.stats.snapshot()
                    drafts = after.num_draft_tokens - before.num_draft_tokens
                    accepted = after.num_accepted_tokens - before.num_accepted_tokens
                    verifications = after.num_drafts - before.num_drafts
                    point["acceptance_rate"] = accepted / drafts if drafts else 0.0
                    point["mean_accepted_length"] = 1 + accepted / verifications if verifications else 0.0
            point["speedup"] = point["on"]["output_tok_per_s"] / point["off"]["output_tok_per_s"]
            results.append(point)
            print(
                f"{name:10s} c={c:3d}  off {point['off']['output_tok_per_s']:7.1f} tok/s  "
                f"on {point['on']['output_tok_per_s']:7.1f} tok/s  x{point['speedup']:.2f}  "
                f"acceptance {point.get('acceptance_rate', 0):.2f}  mean accepted length "
                f"{point.get('mean_accepted_length', 0):.2f}",
                flush=True,
            )
    if args.json is not None:
        args.json.write_text(json.dumps({"model": cores["off"].model_name, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
