"""Tandem against llama.cpp's ``llama-server``: one GGUF file, the same token ids, the same threads.

    python -m benchmarks.vs_llamacpp --llama-server PATH/llama-server --gguf FILE.gguf \\
        [--threads 2] [--repetitions 3] [--cells batch1,concurrent16,concurrent64,prefill_heavy] \\
        [--json OUT.json]

Both are measured as servers, the way a client meets them: llama.cpp's ``llama-server``
(its binary's path is an argument; llama.cpp is not a dependency, benchmarks/figures/vs_llamacpp.md
says how to build it) and a Tandem engine with a frontend serving its OpenAI-compatible
HTTP face, one after the other on free local ports, each driven over loopback by the same
client (benchmarks/completions_load.py) with the same JSON bodies: prompts as token ids,
greedy, ``ignore_eos``, exactly ``max_tokens`` out, not streamed. The thread count is
the same (``--threads``: llama.cpp's ``--threads``/``--threads-batch``, the engine's
``--num-threads``); llama.cpp gets one slot per request of the widest cell, each with room
for the longest request, Tandem the same ``--max-num-seqs``.

Cells (benchmarks/workloads.py draws the ids, seeded; ids < 8192, folded into a smaller
vocabulary): ``batch1`` (requests one at a time, 32-token prompts, 128 out),
``concurrent16`` and ``concurrent64`` (16 / 64 requests at once, 64-256-token prompts, 96
out), ``prefill_heavy`` (benchmarks/workloads/prefill_heavy.jsonl, all 48 at once: long
prompts, a third behind one shared prefix, short outputs).

Each repetition starts each server afresh (the order alternates, so drift in the
machine's load falls on both), warms it up with two short requests, runs every cell
(prompts salted per repetition) and stops it. Printed: per cell the median output
tokens/s of each, their ratio and the goal where there is one (1.0x at batch 1, 1.5x at
16 and 64); the weights' resident memory after warm-up (llama.cpp: the resident pages of
the GGUF it maps plus the weights it repacked into buffers of its own, as its log
reports them; Tandem: the engine's RSS over that of the same engine on the built-in
random demo model, whose weights are about 2 MiB); the CPU, its flags and the load
average. ``--json`` keeps every repetition.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.completions_load import run_cell
from benchmarks.llamacpp_server import LlamaServer, version
from benchmarks.resident import resident
from benchmarks.vs_vllm import LoadSampler, machine
from benchmarks.workloads import HERE, fit_vocab, load, salted, synthetic, write

SIDES = ("llamacpp", "tandem")
ID_RANGE = 8192  # the workloads' ids are drawn below this
WARMUP = [{"prompt_token_ids": [11 + i for i in range(16)], "max_tokens": 8}] * 2


@dataclass(frozen=True)
class Cell:
    name: str
    requests: list[dict]
    concurrency: int
    goal: float | None  # Tandem over llama.cpp, output tokens/s

    def longest(self) -> int:
        """KV positions its longest request needs."""
        return max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in self.requests)


def make_cells(names: list[str], batch1_requests: int, vocab_size: int) -> list[Cell]:
    def drawn(seed: int, n: int, prompt: tuple[int, int], out: int) -> list[dict]:
        return synthetic(seed, num_requests=n, prompt_len=prompt, output_len=(out, out), vocab_size=ID_RANGE)

    heavy = load(HERE / "prefill_heavy.jsonl")
    known = {
        "batch1": lambda: Cell("batch1", drawn(101, batch1_requests, (32, 32), 128), 1, 1.0),
        "concurrent16": lambda: Cell("concurrent16", drawn(116, 16, (64, 256), 96), 16, 1.5),
        "concurrent64": lambda: Cell("concurrent64", drawn(164, 64, (64, 256), 96), 64, 1.5),
        "prefill_heavy": lambda: Cell("prefill_heavy", heavy, len(heavy), None),
    }
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown cells {unknown}; known: {', '.join(known)}")
    cells = [known[n]() for n in names]
    return [Cell(c.name, fit_vocab(c.requests, vocab_size)[0], c.concurrency, c.goal) for c in cells]


def simd_flags() -> list[str]:
    """The CPU's vector-extension flags (AVX, AVX-512, AMX, FMA, F16C), as /proc/cpuinfo says."""
    from engine_svc.model.native import cpu_features

    return sorted(f for f in cpu_features().flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c"))


def gguf_vocab_size(path: str) -> int:
    from gguf import GGUFReader

    return len(GGUFReader(path).fields["tokenizer.ggml.tokens"].data)


# -- the two servers --------------------------------------------------------------------------


@contextlib.contextmanager
def tandem_server(model: str, args, slots: int, overrides: tuple[str, ...] = ()):
    """A Tandem engine and a frontend with the HTTP face on free ports; yields
    (base_url, engine pid, frontend pid) once both serve, stops both after. ``overrides``
    come after ``--tandem-engine-arg``'s, so they win."""
    from tandem_common.ready import read_ready_file
    from tests.services import start_engine, start_frontend

    # The KV cache resident from the start: llama-server clears its KV buffer at start too.
    engine_argv = ["--num-threads", str(args.threads), "--max-num-seqs", str(slots),
                   "--kv-cache-bytes", str(args.tandem_kv_cache_bytes), "--kv-cache-populate",
                   *args.tandem_engine_arg]  # fmt: skip
    engine_argv += overrides
    engine = start_engine(model, *engine_argv)
    frontend = None
    try:
        engine.wait_serving(timeout=600)
        frontend = start_frontend(engine.address, extra=("--http-port", "0", "--max-calls-per-client", "0"))
        frontend.wait_serving(timeout=120)
        port = read_ready_file(frontend.ready_file)["http_port"]
        yield f"http://127.0.0.1:{port}", engine.proc.pid, frontend.proc.pid
    finally:
        if frontend is not None:
            frontend.terminate()
        engine.terminate()


def tandem_baseline(args, slots: int) -> dict:
    """Resident memory of the engine on the built-in random demo model (about 2 MiB of
    weights) with the same flags: what the engine holds besides a model's weights. Its
    float weights take no int8 activations, so that flag is turned off there."""
    from engine_svc.demo_model import ensure_demo_model

    no_a8 = ("--activation-quantization", "none")
    with tandem_server(str(ensure_demo_model()), args, slots, no_a8) as (url, engine_pid, _):
        asyncio.run(run_cell(url, WARMUP, len(WARMUP)))
        return resident(engine_pid)


def run_side(side: str, cells: list[Cell], args, slots: int, ctx: int, salt: int) -> dict:
    """Starts one server, warms it up, runs every cell, stops it."""
    out: dict = {"cells": {}}
    if side == "llamacpp":
        server = LlamaServer(args.llama_server, args.gguf, threads=args.threads, slots=slots, ctx=ctx,
                             extra=args.llama_arg)  # fmt: skip
        with server:
            out["command"] = server.argv
            _drive(server.base_url, cells, salt, out, lambda: resident(server.pid, args.gguf))
            out["buffers_mib"] = server.buffers()
        return out
    t0 = time.perf_counter()
    with tandem_server(args.gguf, args, slots) as (url, engine_pid, frontend_pid):
        out["startup_s"] = time.perf_counter() - t0
        _drive(url, cells, salt, out, lambda: resident(engine_pid, args.gguf))
        out["frontend_memory"] = resident(frontend_pid)
    return out


def _drive(url: str, cells: list[Cell], salt: int, out: dict, memory) -> None:
    warm = asyncio.run(run_cell(url, WARMUP, len(WARMUP)))
    if warm["errors"]:
        raise RuntimeError(f"warm-up failed: {warm['errors'][:3]}")
    out["memory_after_warmup"] = memory()
    for cell in cells:
        with LoadSampler() as load_avg:
            figures = asyncio.run(run_cell(url, salted(cell.requests, salt, ID_RANGE), cell.concurrency))
        if figures["errors"]:
            raise RuntimeError(f"{cell.name}: {len(figures['errors'])} failed requests: {figures['errors'][:3]}")
        figures["loadavg"] = load_avg.summary()
        out["cells"][cell.name] = figures
        print(f"  {cell.name:<14} {figures['output_tok_per_s']:8.1f} output tok/s  "
              f"(load {figures['loadavg']['mean']:.1f})", file=sys.stderr, flush=True)  # fmt: skip
    out["memory_after_cells"] = memory()


# -- figures -----------------------------------------------------------------------------------


def summarize(cells: list[Cell], rounds: list[dict]) -> dict:
    summary: dict = {}
    for cell in cells:
        row: dict = {"goal": cell.goal}
        for side in SIDES:
            rates = [r[side]["cells"][cell.name]["output_tok_per_s"] for r in rounds if side in r]
            row[side] = (
                {"median": statistics.median(rates), "min": min(rates), "max": max(rates), "runs": rates}
                if rates
                else None
            )
        if row["llamacpp"] and row["tandem"]:
            row["ratio"] = row["tandem"]["median"] / row["llamacpp"]["median"]
            row["goal_met"] = None if cell.goal is None else row["ratio"] >= cell.goal
            first = [r for r in rounds if "llamacpp" in r and "tandem" in r][:1]
            if first:
                a, b = (first[0][s]["cells"][cell.name]["texts"] for s in SIDES)
                row["same_text_fraction"] = sum(x == y for x, y in zip(a, b)) / len(a)
        summary[cell.name] = row
    return summary


def memory_summary(rounds: list[dict], baseline: dict | None) -> dict:
    out: dict = {}
    llama = [r["llamacpp"] for r in rounds if "llamacpp" in r]
    if llama:
        mem, buffers = llama[-1]["memory_after_warmup"], llama[-1]["buffers_mib"]
        repacked = buffers.get("model:CPU_REPACK", 0.0)  # weights copied out of the map, in its own layout
        out["llamacpp"] = {
            "weights_resident_mib": mem["file_mapped_mib"] + repacked,
            "gguf_mapped_resident_mib": mem["file_mapped_mib"],
            "repacked_mib": repacked,
            "model_buffers_reported_mib": buffers.get("model"),
            "rss_mib": mem["rss_mib"],
            "buffers_mib": buffers,
        }
    tandem = [r["tandem"] for r in rounds if "tandem" in r]
    if tandem:
        mem = tandem[-1]["memory_after_warmup"]
        out["tandem"] = {"engine_rss_mib": mem["rss_mib"], "engine_anon_mib": mem["anon_mib"],
                         "gguf_mapped_resident_mib": mem["file_mapped_mib"],
                         "frontend_rss_mib": tandem[-1]["frontend_memory"]["rss_mib"]}  # fmt: skip
        if baseline is not None:
            out["tandem"]["baseline_engine_rss_mib"] = baseline["rss_mib"]
            out["tandem"]["weights_resident_mib"] = mem["rss_mib"] - baseline["rss_mib"]
    return out


def finished(report: dict, cells: list[Cell], rounds: list[dict], baseline: dict | None) -> dict:
    """The report with the figures of the rounds run so far (the answers' texts left out)."""

    def plain(run: dict) -> dict:
        cells_ = {name: {k: v for k, v in f.items() if k != "texts"} for name, f in run["cells"].items()}
        return {**run, "cells": cells_}

    return {
        **report,
        "loadavg_end": os.getloadavg(),
        "summary": summarize(cells, rounds),
        "memory": memory_summary(rounds, baseline),
        "tandem_baseline_memory": baseline,
        "rounds": [{side: plain(run) for side, run in r.items()} for r in rounds],
    }


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_report(report: dict) -> None:
    print(f"\n{report['gguf']}  ({report['gguf_mib']:.1f} MiB), {report['threads']} threads, "
          f"{report['repetitions']} repetitions, medians")  # fmt: skip
    print(f"{'cell':<15}{'llama.cpp tok/s':>16}{'tandem tok/s':>14}{'ratio':>8}{'goal':>7}  same text")
    for name, row in report["summary"].items():
        llama, tandem = row["llamacpp"], row["tandem"]
        met = "" if row.get("goal_met") is None else (" met" if row["goal_met"] else " NOT met")
        print(f"{name:<15}{_fmt(llama and llama['median']):>16}{_fmt(tandem and tandem['median']):>14}"
              f"{_fmt(row.get('ratio'), '.2f'):>8}{_fmt(row['goal'], '.1f'):>7}{met}  "
              f"{_fmt(row.get('same_text_fraction'), '.2f')}")  # fmt: skip
    for side, mem in report["memory"].items():
        print(f"memory {side}: " + ", ".join(f"{k} {_fmt(v) if not isinstance(v, dict) else ''}".rstrip()
                                              for k, v in mem.items() if not isinstance(v, dict)))  # fmt: skip
    load = ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(report["loadavg_start"][:2], report["loadavg_end"][:2]))
    print(
        f"cpu: {report['machine']['cpu_model']} ({', '.join(report['simd_flags'])}); "
        f"load average 1/5 min at start/end: {load}"
    )


# -- the command line --------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vs_llamacpp", description=__doc__.splitlines()[0])
    p.add_argument("--llama-server", required=True, metavar="PATH", help="llama.cpp's llama-server binary")
    p.add_argument("--gguf", required=True, metavar="FILE", help="the GGUF file both serve")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="default: this process's CPUs")
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--cells", default="batch1,concurrent16,concurrent64,prefill_heavy")
    p.add_argument("--batch1-requests", type=int, default=4, help="requests of the batch1 cell, one at a time")
    p.add_argument("--sides", default=",".join(SIDES), help="llamacpp, tandem or both")
    p.add_argument("--llama-arg", action="append", default=[], metavar="ARG", help="extra llama-server argument")
    p.add_argument("--tandem-engine-arg", action="append", default=[], metavar="ARG",
                   help="extra engine argument (repeat; e.g. =--quantization then =none)")  # fmt: skip
    p.add_argument("--tandem-kv-cache-bytes", type=int, default=2 << 30)
    p.add_argument("--no-tandem-baseline", action="store_true", help="skip the demo-model engine's memory baseline")
    p.add_argument("--json", default=None)
    p.add_argument("--write-cells", default=None, metavar="DIR",
                   help="write each cell's requests to DIR/<cell>.jsonl (for benchmarks.vs_vllm) and exit")  # fmt: skip
    args = p.parse_args(argv)
    args.cells = [c for c in args.cells.split(",") if c]
    args.sides = [s for s in args.sides.split(",") if s]
    if not set(args.sides) <= set(SIDES) or not args.sides:
        p.error(f"--sides: one or both of {', '.join(SIDES)}")
    if not Path(args.gguf).is_file():
        p.error(f"--gguf {args.gguf!r} is not a file")
    if "llamacpp" in args.sides and not args.write_cells and not os.access(args.llama_server, os.X_OK):
        p.error(
            f"--llama-server {args.llama_server!r} is not an executable file "
            "(benchmarks/figures/vs_llamacpp.md: building it)"
        )
    if args.threads < 1 or args.repetitions < 1 or args.batch1_requests < 1:
        p.error("--threads, --repetitions and --batch1-requests must be at least 1")
    return args


def prepare(args) -> tuple[list[Cell], int, int]:
    """The cells, llama.cpp's slots (= Tandem's --max-num-seqs) and its KV cache's tokens:
    room for the longest request in every slot."""
    cells = make_cells(args.cells, args.batch1_requests, gguf_vocab_size(args.gguf))
    slots = max(c.concurrency for c in cells)
    ctx = slots * math.ceil(max(c.longest() for c in cells) / 256) * 256
    return cells, slots, ctx


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cells, slots, ctx = prepare(args)
    if args.write_cells:
        for cell in cells:
            write(cell.name, cell.requests, Path(args.write_cells))
        return 0
    report: dict = {"gguf": args.gguf, "gguf_mib": Path(args.gguf).stat().st_size / 2**20, "threads": args.threads,
                    "repetitions": args.repetitions, "slots": slots, "llama_ctx": ctx, "machine": machine(),
                    "simd_flags": simd_flags(), "loadavg_start": os.getloadavg()}  # fmt: skip
    if "llamacpp" in args.sides:
        report["llamacpp_version"] = version(args.llama_server)
    baseline = None
    if "tandem" in args.sides and not args.no_tandem_baseline:
        baseline = tandem_baseline(args, slots)
    rounds: list[dict] = []
    for i in range(args.repetitions):
        order = args.sides if i % 2 == 0 else args.sides[::-1]
        rounds.append({})
        for side in order:
            print(f"repetition {i + 1}/{args.repetitions}: {side}", file=sys.stderr, flush=True)
            rounds[-1][side] = run_side(side, cells, args, slots, ctx, salt=i + 1)
            if args.json:  # after every server's run, so an interrupted run keeps what it measured
                Path(args.json).write_text(json.dumps(finished(report, cells, rounds, baseline), indent=2))
    final = finished(report, cells, rounds, baseline)
    print_report(final)
    if args.json:
        Path(args.json).write_text(json.dumps(final, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
