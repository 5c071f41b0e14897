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

This file is the command line; the calls and the figures are in serve_load.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

from benchmarks.serve_load import drive, saturation_rate


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
