"""The quantized GEMM (quant.c) against the float32 packed GEMM (gemm.c), per row count.

    python -m benchmarks.quant_gemm [--rows 1 2 4 5 8 16 32 64 256] [--formats int4 int8]
        [--threads 1] [--clock cpu|wall] [--repeats 7] [--json OUT]

For each row count, the time of one pass over a model's linear layers (SmolLM2-135M's
shapes: q/k/v fused 960 x 576, o 576 x 576, gate/up fused 3072 x 576, down 576 x 1536; 30
layers, each with its own random weights, so they stream from memory as a model's do), in
float32 on the native packed GEMM and on the quantized GEMM with the same
weights quantized (int4: scale and min per group of 32, Q4_1's layout; int8: per group of
32, Q8_0's), float32 activations. ``--clock cpu`` times by the process's CPU time (for a
shared machine; use it with one thread), ``wall`` by the clock. Each figure is the median of
``--repeats`` timed runs of enough passes to take ~0.2 s, the formats timed in turns. Prints
one line per row count with
the ratio float32 / quantized (above 1: the quantized GEMM is faster), the CPU and the load
average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from engine_svc.model.native import cpu_features, load_kernels
from engine_svc.model.native.quant import quantize_int4, quantize_int8

# SmolLM2-135M: [N, K] of each linear layer as the engine fuses them, and its layer count.
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
NUM_LAYERS = 30
QUANTIZERS = {"int4": quantize_int4, "int8": quantize_int8}
# Weight formats, and with "-a8" the same weights with int8 activations (integer dot products).
FORMATS = {**{f: (f, False) for f in QUANTIZERS}, **{f"{f}-a8": (f, True) for f in QUANTIZERS}}


def timed(fns: dict[str, Callable[[], object]], clock: Callable[[], float], repeats: int) -> dict[str, float]:
    """Median seconds per call of each of ``fns``, timed in turns (each repeat times every
    function once), so that a change in the machine's load falls on all of them alike."""
    passes = {}
    for name, fn in fns.items():
        fn()
        start, calls = clock(), 0
        while clock() - start < 0.05 or calls < 3:
            fn()
            calls += 1
        passes[name] = max(3, int(0.2 / max((clock() - start) / calls, 1e-7)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = clock()
            for _ in range(passes[name]):
                fn()
            samples[name].append((clock() - start) / passes[name])
    return {name: statistics.median(v) for name, v in samples.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 5, 8, 16, 32, 64, 256])
    p.add_argument("--formats", nargs="+", default=["int4", "int8"], choices=sorted(FORMATS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="activations")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    kernels = load_kernels()
    if kernels is None:
        raise SystemExit("no native kernels on this machine")
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    # Every layer its own weights, as in a model: a pass streams them from memory, not cache.
    layers = [(name, torch.randn(n, k) * 0.05) for _ in range(NUM_LAYERS) for name, (n, k) in SHAPES.items()]
    packed = [(name, kernels.pack(w, None, dtype)) for name, w in layers]
    qpack = getattr(kernels, "qpack", lambda w: w)  # checkouts before the panel layout took QuantizedWeight
    weights = {FORMATS[f][0] for f in args.formats}
    quantized = {f: [(name, qpack(QUANTIZERS[f](w))) for name, w in layers] for f in weights}
    del layers
    features = cpu_features()
    print(f"{features.model_name}; build {kernels.isa}; {args.threads} thread(s), {args.clock} time, x {args.dtype}")
    load_before = os.getloadavg()
    rows_out = []
    for m in args.rows:
        xs = {name: torch.randn(m, k).to(dtype) for name, (_, k) in SHAPES.items()}
        row: dict[str, object] = {"rows": m}
        fns = {"float32": lambda xs=xs: [kernels.gemm(xs[n], w) for n, w in packed]}
        for f in args.formats:
            weight, a8 = FORMATS[f]
            fns[f] = lambda weight=weight, a8=a8, xs=xs: [
                kernels.qgemm(xs[n], w, int8_activations=a8) if a8 else kernels.qgemm(xs[n], w)
                for n, w in quantized[weight]
            ]
        times = timed(fns, clock, args.repeats)
        f32 = times["float32"]
        row["float32_ms"] = 1e3 * f32
        line = f"rows {m:4d}: float32 {row['float32_ms']:8.2f} ms"
        for f in args.formats:
            q = times[f]
            row[f"{f}_ms"] = 1e3 * q
            row[f"{f}_speedup"] = f32 / q
            line += f" | {f} {row[f'{f}_ms']:8.2f} ms ({f32 / q:.2f}x)"
        print(line, flush=True)
        rows_out.append(row)
    load_after = os.getloadavg()
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    if args.json:
        result = {
            "cpu": features.model_name,
            "flags": features.reported(),
            "isa": kernels.isa,
            "threads": args.threads,
            "clock": args.clock,
            "activations": args.dtype,
            "load_average_before": load_before,
            "load_average_after": load_after,
            "rows": rows_out,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
