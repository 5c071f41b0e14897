"""A decode step's native kernels alone, at one and two threads, against another commit's.

    python -m benchmarks.decode_kernels [--baseline REV] [--rows 8 37] [--threads 1 2]
        [--parts gemm attention prefill] [--dtype float32] [--repeats 7] [--block-size 16] [--json OUT]

Parts of a step, on SmolLM2-135M's shapes (30 layers; hidden 576, 9 query and
3 KV heads of 64, intermediate 1536, vocabulary 49,152):

* ``gemm``: one pass over the step's linear layers as the engine fuses them (qkv, o,
  gate/up with the SiLU epilogue, down; then the LM head), every layer with its own
  weights, so that they stream from memory as a model's do (538 MB in float32).
* ``prefill`` (not by default; ``--rows`` are then a step's prompt tokens, 4096 say):
  prefill attention of every layer over whole prompts of 300-900 tokens.
* ``attention``: decode attention of every layer over a paged cache whose blocks are
  scattered through the pool, as a running engine's are (contexts 100-700 tokens, drawn
  once; block size 16, or `--block-size`).

Each is timed on this checkout's kernels and, with ``--baseline``, on the same sources at
another commit of the same C API (``tandem_api.h``'s TK_API_VERSION: the bindings refuse a
build of another), built with the same flags into a temporary folder; every (build, threads)
arm is timed in turns (``quant_gemm.timed``: each repeat times every arm once, so a change
in the machine's load falls on all of them alike), wall clock, median of ``--repeats``.
Every arm's outputs are compared bit for bit with its build's first arm's: the kernels
never split a sum across threads, so neither the thread count nor the work split may
change a bit; between builds (a change of summation order) the largest difference is
printed.
Prints ms per pass and the ratio to the baseline at the same thread count, the CPU, its
flags and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.quant_gemm import timed
from engine_svc.model.native import NativeKernels, cpu_features, load_kernels
from engine_svc.model.native.build import HEADERS, SOURCES, compiler, flags

HIDDEN, INTER, VOCAB, LAYERS = 576, 1536, 49152, 30
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
NATIVE = "engine_svc/model/native"


def build_at(rev: str, isa: str, folder: Path) -> NativeKernels:
    """The kernels' sources at commit ``rev``, built for ``isa`` with the engine's flags."""
    for name in (*SOURCES, *HEADERS):
        src = subprocess.run(["git", "show", f"{rev}:{NATIVE}/{name}"], capture_output=True)
        if src.returncode == 0:  # a header this checkout added is absent there, and not included
            (folder / name).write_bytes(src.stdout)
    lib = folder / f"tandem_kernels-{isa}-{rev.replace('/', '_')}.so"
    cc = compiler() or "cc"
    sources = [str(folder / s) for s in SOURCES if (folder / s).is_file()]  # what that commit had
    subprocess.run([cc, *flags(isa), "-shared", *sources, "-o", str(lib), "-lm"],
                   check=True)  # fmt: skip
    return NativeKernels(lib, isa)


def gemm_part(kernels: dict[str, NativeKernels], rows: int, dtype: torch.dtype):
    """Per build: a function making one pass over the step's linear layers."""
    torch.manual_seed(0)
    shapes = [("qkv", (HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, False), ("o", HIDDEN, HEADS * HEAD_DIM, False),
              ("gate_up", 2 * INTER, HIDDEN, True), ("down", HIDDEN, INTER, False)]  # fmt: skip
    weights = [(k, torch.randn(n, k) * 0.05, silu) for _ in range(LAYERS) for _, n, k, silu in shapes]
    weights.append((HIDDEN, torch.randn(VOCAB, HIDDEN) * 0.05, False))
    xs = {k: torch.randn(rows, k).to(dtype) for k in {w[0] for w in weights}}
    fns = {}
    for name, kern in kernels.items():
        # each build packs its own: the layout is the build's to choose
        packed = [(k, kern.pack(w, None, dtype, silu_mul=silu)) for k, w, silu in weights]
        fns[name] = lambda kern=kern, packed=packed: [kern.gemm(xs[k], w) for k, w in packed]
    return fns


def attention_part(kernels: dict[str, NativeKernels], rows: int, dtype: torch.dtype, block: int = 16):
    """Per build: a function running decode attention over every layer's cache."""
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(100, 701, (rows,), generator=gen, dtype=torch.int32)
    per_row = [(int(c) + block - 1) // block for c in ctx]
    num_blocks = sum(per_row)
    stride = max(per_row)
    caches, tables = [], []
    for _ in range(LAYERS):
        k = torch.randn(num_blocks, block, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(num_blocks, block, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        order = torch.randperm(num_blocks, generator=gen).to(torch.int32)  # blocks anywhere in the pool
        table = torch.zeros(rows, stride, dtype=torch.int32)
        used = 0
        for r, n in enumerate(per_row):
            table[r, :n] = order[used : used + n]
            used += n
        caches.append((k, v))
        tables.append(table)
    q = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    max_ctx = int(ctx.max())
    scale = HEAD_DIM**-0.5
    fns = {}
    for name, kern in kernels.items():
        out = torch.empty(LAYERS, rows, HEADS, HEAD_DIM, dtype=dtype)

        def run(kern=kern, out=out):
            for layer, ((k, v), table) in enumerate(zip(caches, tables)):
                kern.decode_attention(out[layer], q, k, v, table, ctx, max_ctx, scale)
            return [out]

        fns[name] = run
    num_bytes = int(ctx.sum()) * LAYERS * 2 * KV_HEADS * HEAD_DIM * q.element_size()  # K and V read once
    return fns, num_bytes


def prefill_part(kernels: dict[str, NativeKernels], rows: int, dtype: torch.dtype, block: int = 16):
    """Per build: prefill attention of every layer for one step of ``rows`` prompt tokens,
    whole prompts of 300-900 tokens from position 0 (the prefill-heavy workload's), their
    blocks scattered."""
    gen = torch.Generator().manual_seed(1)
    lens: list[int] = []
    while sum(lens) < rows:
        lens.append(min(int(torch.randint(300, 901, (1,), generator=gen)), rows - sum(lens)))
    per = [-(-n // block) for n in lens]
    num_blocks = sum(per)
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.zeros(len(lens), max(per), dtype=torch.int32)
    for c, n in enumerate(per):
        table[c, :n] = order[sum(per[:c]) : sum(per[:c]) + n]
    caches = [tuple(torch.randn(num_blocks, block, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
              for _ in range(LAYERS)]  # fmt: skip
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    starts, chunk_rows = torch.zeros_like(lens_t), (torch.cumsum(lens_t, 0) - lens_t).to(torch.int32)
    fns = {}
    for name, kern in kernels.items():
        out = torch.empty(LAYERS, rows, HEADS, HEAD_DIM, dtype=dtype)

        def run(kern=kern, out=out):
            for layer, (k, v) in enumerate(caches):
                kern.prefill_attention(out[layer], qkv[:, : HEADS * HEAD_DIM], k, v, table, chunk_rows, starts, lens_t,
                                       HEAD_DIM**-0.5)  # fmt: skip
            return [out]

        fns[name] = run
    return fns


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def threaded(fn, n: int):
    def run():
        torch.set_num_threads(n)
        return fn()

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default=None, help="a commit whose kernels to time beside this checkout's")
    p.add_argument("--rows", type=int, nargs="+", default=[8, 37])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--parts", nargs="+", choices=("gemm", "attention", "prefill"), default=["gemm", "attention"])
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block of the attention part")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    current = load_kernels()
    if current is None:
        raise SystemExit("no native kernels on this machine")
    dtype = getattr(torch, args.dtype)
    features = cpu_features()
    with tempfile.TemporaryDirectory(prefix="tandem-decode-kernels-") as tmp:
        kernels = {}
        if args.baseline:
            kernels["base"] = build_at(args.baseline, current.isa, Path(tmp))
        kernels["new"] = current
        cpu_flags = " ".join(f for f, on in features.reported().items() if on)
        print(f"{features.model_name}; flags {cpu_flags}; build {current.isa}; {args.dtype}; "
              f"baseline {args.baseline or '-'}", flush=True)  # fmt: skip
        results = []
        for part in args.parts:
            for rows in args.rows:
                if part == "gemm":
                    fns, num_bytes = gemm_part(kernels, rows, dtype), None
                elif part == "prefill":
                    fns, num_bytes = prefill_part(kernels, rows, dtype, args.block_size), None
                else:
                    fns, num_bytes = attention_part(kernels, rows, dtype, args.block_size)
                arms = {f"{b}@{n}": threaded(fn, n) for n in args.threads for b, fn in fns.items()}
                # Within a build, the thread count may not change a bit; between builds, a
                # change of summation order may: the largest difference is printed.
                firsts, max_diff = {}, 0.0
                for name, fn in arms.items():
                    out = [t.clone() for t in fn()]
                    build = name.split("@")[0]
                    first = firsts.setdefault(build, out)
                    if any(not torch.equal(_bits(a), _bits(b)) for a, b in zip(first, out)):
                        raise SystemExit(f"{part}, {rows} rows: {name}'s outputs differ from {build}'s first arm's")
                    ref = next(iter(firsts.values()))
                    max_diff = max([max_diff] + [(a.float() - b.float()).abs().max().item() for a, b in zip(ref, out)])
                del firsts, out
                load_before = os.getloadavg()
                times = timed(arms, time.perf_counter, args.repeats)
                load_after = os.getloadavg()
                row = {"part": part, "rows": rows, "ms": {k: 1e3 * v for k, v in times.items()},
                       "load_average": [load_before[0], load_after[0]]}  # fmt: skip
                line = f"{part:9s} rows {rows:3d}:"
                for n in args.threads:
                    t = times[f"new@{n}"]
                    line += f" | {n} thr: {1e3 * t:7.2f} ms"
                    if num_bytes:
                        line += f" ({num_bytes / t / 1e9:4.1f} GB/s)"
                    if args.baseline:
                        b = times[f"base@{n}"]
                        line += f" (base {1e3 * b:7.2f}, {b / t:.2f}x)"
                        row[f"speedup@{n}"] = b / t
                if args.baseline:
                    line += f" | max |new - base| {max_diff:.2e}"
                    row["max_abs_diff"] = max_diff
                line += f" | load {load_before[0]:.2f}-{load_after[0]:.2f}"
                print(line, flush=True)
                results.append(row)
                del fns, arms
    if args.json:
        result = {"cpu": features.model_name, "flags": features.reported(), "isa": current.isa,
                  "dtype": args.dtype, "baseline": args.baseline, "results": results}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
