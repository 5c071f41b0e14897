"""The whole engine on a quantized checkpoint, its layers kept quantized against dequantized.

    python -m benchmarks.quant_engine --model PATH [--quantization auto none] [--batch 1 16 64]
        [--prompt-len 32] [--max-tokens 48] [--prefill 16x256] [--threads 1] [--clock cpu|wall]
        [--repeats 2] [--json OUT]

Each ``--quantization`` value is one engine (``auto``: a GGUF file's blocks or a GPTQ / AWQ
/ compressed-tensors checkpoint's integers as they are; ``none``: dequantized to float32 at
load; ``+a8`` adds ``--activation-quantization int8``, e.g. ``auto+a8``, ``+a32`` ``none``), in its own process so
that its resident memory is its own. Per batch size, that
many requests of ``--prompt-len`` random ids (seeded) arrive at once and each decodes
``--max-tokens`` tokens (greedy, ignore_eos); the figure is output tokens per second of
``--clock`` (``cpu``: the process's CPU time, for a shared machine, with ``--threads 1``;
``wall``: the clock), the best of ``--repeats``. ``--prefill RxL`` adds R prompts of L ids
with one output token each: prompt tokens per second. Also printed: the process's resident
memory after loading (VmRSS) and the bytes of the model's weights as held.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

# A value's suffix: ``+a8`` int8 activations, ``+a32`` float32 ones, none: the engine's
# default (``auto``: int8 where the checkpoint declares them).
ACTIVATIONS = {"": "auto", "a8": "int8", "a32": "none"}


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _weight_bytes(model) -> int:
    """Bytes of every distinct tensor the model's modules hold: parameters, buffers, and the
    packed weights kept beside them (float panels, quantized panels), counted once each."""
    import torch

    seen: set[int] = set()

    def tensors(value, depth: int = 0):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for v in value:
                yield from tensors(v, depth)
        elif depth < 2 and hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module):
            for v in vars(value).values():
                yield from tensors(v, depth + 1)

    total = 0
    for module in model.modules():
        for t in tensors([*module.parameters(recurse=False), *module.buffers(recurse=False), *vars(module).values()]):
            if not t.is_meta and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
    return total


def run_one(args) -> dict:
    """One engine, in this process."""
    import torch

    from engine_svc.config import EngineConfig
    from engine_svc.core import EngineCore
    from engine_svc.types import SamplingParams

    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    t0 = time.perf_counter()
    weights, _, a8 = args.quantization[0].partition("+")
    core = EngineCore(
        EngineConfig(
            model=args.model, dtype="float32", quantization=weights, num_kv_blocks=args.kv_blocks,
            max_num_seqs=max(args.batch), max_num_batched_tokens=args.max_num_batched_tokens,
            activation_quantization=ACTIVATIONS[a8],
        )
    )  # fmt: skip
    load_s = time.perf_counter() - t0
    rss_loaded = _rss_mib()
    core.warmup()
    rng = random.Random(0)
    vocab = core.runner.vocab_size
    out: dict = {
        "quantization": args.quantization[0],
        "matmuls": core.runner.matmuls,
        "load_s": load_s,
        "rss_after_load_mib": rss_loaded,
        "weight_mib": _weight_bytes(core.runner.model) / 2**20,
        "decode": {},
    }
    cases = [(b, args.prompt_len, args.max_tokens, "decode") for b in args.batch]
    if args.prefill:
        rows, length = (int(v) for v in args.prefill.split("x"))
        cases.append((rows, length, 1, "prefill"))
    for batch, prompt_len, max_tokens, kind in cases:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        best = float("inf")
        for _ in range(args.repeats):
            prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch)]
            start = clock()
            results = core.generate(prompts, params)
            best = min(best, clock() - start)
            assert all(len(r.output_token_ids) == max_tokens for r in results)
        if kind == "decode":
            out["decode"][str(batch)] = batch * max_tokens / best
        else:
            out["prefill_tok_per_s"] = batch * prompt_len / best
            out["prefill"] = f"{batch}x{prompt_len}"
    out["rss_after_run_mib"] = _rss_mib()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--quantization", nargs="+", default=["auto", "none"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prefill", default=None, help="RxL: R prompts of L ids, one output token each")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--kv-blocks", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one engine, JSON out
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args)))
        return 0
    from engine_svc.model.native import cpu_features

    features = cpu_features()
    print(f"{features.model_name}; {args.threads} thread(s), {args.clock} time; load average {os.getloadavg()}")
    rows = []
    for method in args.quantization:
        child = [a for a in (argv if argv is not None else sys.argv[1:])]
        child = _replace(child, "--quantization", [method]) + ["--one"]
        proc = subprocess.run([sys.executable, "-m", "benchmarks.quant_engine", *child], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"--quantization {method} failed:\n{proc.stderr[-3000:]}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(row)
        decode = ", ".join(f"batch {b}: {v:.1f}" for b, v in row["decode"].items())
        prefill = f"; prefill {row['prefill']}: {row['prefill_tok_per_s']:.1f} tok/s" if "prefill" in row else ""
        print(
            f"{method:5s} ({row['matmuls']}): output tok/s {decode}{prefill}; weights {row['weight_mib']:.1f} MiB, "
            f"RSS {row['rss_after_load_mib']:.0f} MiB after load, {row['rss_after_run_mib']:.0f} after the runs",
            flush=True,
        )
    if len(rows) == 2:
        ratios = {b: rows[0]["decode"][b] / rows[1]["decode"][b] for b in rows[0]["decode"]}
        print(f"{rows[0]['quantization']} / {rows[1]['quantization']}: " + ", ".join(
            f"batch {b}: {r:.2f}x" for b, r in ratios.items()
        ))  # fmt: skip
    if args.json:
        result = {"cpu": features.model_name, "flags": features.reported(), "threads": args.threads,
                  "clock": args.clock, "load_average_after": os.getloadavg(), "rows": rows}  # fmt: skip
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def _replace(argv: list[str], flag: str, values: list[str]) -> list[str]:
    """``argv`` with ``flag``'s values replaced (or added)."""
    out, skip = [], False
    for a in argv:
        if a == flag:
            skip = True
            continue
        if skip and not a.startswith("--"):
            continue
        skip = False
        out.append(a)
    return [*out, flag, *values]


if __name__ == "__main__":
    raise SystemExit(main())
