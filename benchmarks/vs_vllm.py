"""Tandem against vLLM's CPU build: one workload, one machine, one after the other.

    python -m benchmarks.vs_vllm --python VLLM_VENV/bin/python --model DIR \\
        --workload benchmarks/workloads/standard.jsonl --dtype float32 --json OUT.json \\
        [--max-requests N] [--tandem-dtype auto]

First vLLM's offline ``LLM.generate`` runs the workload in the given interpreter (an
environment that has vLLM; vLLM is not a dependency of this project) through
``benchmarks/vllm_driver.py``, with its threads bound to this process's CPUs
(``VLLM_CPU_OMP_THREADS_BIND``) and tcmalloc and the venv's OpenMP preloaded, as vLLM's
CPU docs advise. Then the Tandem engine runs the same token ids in this process. Both:
every request at once, greedy, ``ignore_eos``, prefix caching on, token ids out.

Printed and written: output tokens/s of each and their ratio; the workload's model FLOPs
(benchmarks/flops.py, prefix-cache hits excluded), this machine's matmul peak for the
dtype measured in the same run, the ceiling they imply and the fraction of it each engine
reached; Tandem's achieved FLOP/s per step kind; the target of issue #15 (1.3x vLLM, or
85% of the ceiling where that is lower, and ahead of vLLM) and whether it was met; the
CPU, its flags, thread counts, versions and the load average during each run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

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

DRIVER = Path(__file__).with_name("vllm_driver.py")
TCMALLOC = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/lib/x86_64-linux-gnu")
TARGET_RATIO, TARGET_CEILING_FRACTION = 1.3, 0.85
_OWN_PROCESS_GROUP: dict = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}


class LoadSampler:
    """The 1-minute load average every few seconds while a run lasts."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.every_s = every_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self.samples.append(os.getloadavg()[0])
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])

    def summary(self) -> dict:
        s = self.samples
        return {"mean": sum(s) / len(s), "min": min(s), "max": max(s), "samples": len(s)}


def machine() -> dict:
    import torch

    from engine_svc.model.native import cpu_features

    features = cpu_features()
    return {
        "cpu_model": features.model_name,
        "cpu_flags": features.reported(),
        "kernel_isa": features.kernel_isa,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "num_cpus": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "tandem_commit": _git_commit(),
    }


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def vllm_env(python: str, extra: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    preload = [str(Path(d) / n) for n in TCMALLOC for d in LIB_DIRS if (Path(d) / n).is_file()][:1]
    iomp = Path(python).resolve().parent.parent / "lib" / "libiomp5.so"
    if not iomp.is_file():
        iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        preload.append(str(iomp))
    cpus = sorted(os.sched_getaffinity(0))
    contiguous = cpus == list(range(cpus[0], cpus[-1] + 1))
    env.update(
        {
            "LD_PRELOAD": ":".join(preload),
            "VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}-{cpus[-1]}" if contiguous else ",".join(map(str, cpus)),
            "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "2"),
            "HF_HUB_OFFLINE": "1",
        }
    )
    for item in extra:
        key, _, value = item.partition("=")
        env[key] = value
    return env


def run_vllm(args, workload_path: str, num_requests: int) -> dict:
    """vLLM in its own interpreter and process group (killed whole on a timeout, so no
    engine process outlives the run). A process group, not a session: on Linux a new
    session is a new scheduler autogroup, which would run vLLM at the default share
    whatever priority this process (and so Tandem's side) runs at."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "vllm.json"
        cmd = [args.python, str(DRIVER), "--model", args.model, "--workload", workload_path, "--dtype", args.dtype,
               "--max-requests", str(num_requests), "--out", str(out)]  # fmt: skip
        if args.vllm_max_num_seqs is not None:
            cmd += ["--max-num-seqs", str(args.vllm_max_num_seqs)]
        env = vllm_env(args.python, args.vllm_env)
        t0 = time.perf_counter()
        with LoadSampler() as load_avg:
            proc = subprocess.Popen(cmd, env=env, stdout=sys.stderr, stderr=sys.stderr, **_OWN_PROCESS_GROUP)
            try:
                rc = proc.wait(timeout=args.vllm_timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise RuntimeError(f"vLLM did not finish in {args.vllm_timeout} s") from None
            finally:
                try:  # whatever it started and left behind in its process group
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if rc != 0 or not out.is_file():
            raise RuntimeError(f"vLLM driver failed (exit {rc})")
        result = json.loads(out.read_text())
    result["process_s"] = time.perf_counter() - t0
    result["loadavg"] = load_avg.summary()
    result["env"] = {k: env[k] for k in ("LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")}
    return result


def run_tandem(args, workload: list[dict], shape: ModelShape) -> dict:
    from engine_svc.config import EngineConfig, build_parser
    from engine_svc.core import EngineCore
    from engine_svc.types import SamplingParams

    argv = ["--model", args.model, "--dtype", args.tandem_dtype or args.dtype, "--kernels", args.kernels,
            "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--kv-cache-bytes", str(2 << 30), "--kv-cache-populate", *args.tandem_arg]  # fmt: skip
    # Both engines reserve 2 GiB of KV cache at start (vLLM's VLLM_CPU_KVCACHE_SPACE, zero-filled
    # before it serves), so neither run's steps pay the page faults of a block's first use.
    t0 = time.perf_counter()
    core = EngineCore(EngineConfig.from_args(build_parser().parse_args(argv)))
    core.warmup()
    startup_s = time.perf_counter() - t0
    recorder = StepRecorder(shape)
    recorder.attach(core)
    prompts = [r["prompt_token_ids"] for r in workload]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in workload]
    with LoadSampler() as load_avg:
        t0 = time.perf_counter()
        results = core.generate(prompts, params)
        wall = time.perf_counter() - t0
    num_output = sum(len(c.output_token_ids) for c in results)
    runner = core.runner
    return {
        "engine": "tandem",
        "dtype": str(runner.dtype).removeprefix("torch."),
        "kernels": runner.kernels.isa if runner.kernels else None,
        "matmuls": runner.matmuls,
        "kv_element_bytes": runner.kv_caches[0][0].element_size(),
        "weight_element_bytes": torch.empty((), dtype=runner.dtype).element_size(),
        "engine_args": args.tandem_arg,
        "num_requests": len(workload),
        "num_output_tokens": num_output,
        "num_cached_prompt_tokens": sum(c.num_cached_tokens for c in results),
        "wall_s": wall,
        "output_tok_per_s": num_output / wall,
        "startup_s": startup_s,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "num_steps": core.num_steps,
        "phases": recorder.summary(),
        "threads": runner.threads.summary() if runner.threads else None,
        "loadavg": load_avg.summary(),
        "output_token_ids": [c.output_token_ids for c in results],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--python", help="interpreter of an environment with vLLM (omit with --skip-vllm)")
    p.add_argument("--model", required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--tandem-dtype", default=None, help="Tandem's --dtype if not --dtype (e.g. auto)")
    p.add_argument("--kernels", default="auto", choices=["auto", "torch"])
    p.add_argument("--max-requests", type=int, default=0, help="the first N requests only, on both sides (0 = all)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--vllm-max-num-seqs", type=int, default=None,
                   help="vLLM's max_num_seqs (default: its own, 256); 1 runs the requests one at a time")  # fmt: skip
    p.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE", help="extra environment for vLLM")
    p.add_argument("--vllm-timeout", type=float, default=3600)
    p.add_argument("--skip-vllm", action="store_true", help="Tandem only (no ratio)")
    p.add_argument("--tandem-arg", action="append", default=[], metavar="ARG",
                   help="extra engine argument (repeat; e.g. =--activation-quantization then =int8)")  # fmt: skip
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not args.skip_vllm and not args.python:
        p.error("--python is required unless --skip-vllm")

    workload = load(args.workload)
    if args.max_requests:
        workload = workload[: args.max_requests]
    shape = ModelShape.from_model_dir(args.model)
    report: dict = {"model": args.model, "workload": args.workload, "dtype": args.dtype, "machine": machine()}
    report["num_requests"] = len(workload)
    num_threads = torch.get_num_threads()
    if not args.skip_vllm:
        report["vllm"] = run_vllm(args, args.workload, len(workload))
        print(f"vllm    {report['vllm']['output_tok_per_s']:.1f} output tok/s", flush=True)
    report["tandem"] = run_tandem(args, workload, shape)
    print(f"tandem  {report['tandem']['output_tok_per_s']:.1f} output tok/s", flush=True)

    flops = workload_flops(shape, workload)
    # At every core: the engine's thread governor may have left torch on fewer.
    torch.set_num_threads(num_threads)
    peak = matmul_peak(args.dtype, shape)
    memory = memory_read_rate()
    ceil = ceiling(flops, peak["gflops"])
    report.update(flops=flops, peak=peak, memory=memory, ceiling=ceil)
    for side in ("vllm", "tandem"):
        if side in report:
            r = report[side]
            r["ceiling_fraction"] = r["output_tok_per_s"] / ceil["output_tok_per_s"]
            r["achieved_gflops"] = flops["total"] / r["wall_s"] / 1e9
    line = f"ceiling {ceil['output_tok_per_s']:.1f} output tok/s (peak {peak['gflops']:.1f} GFLOP/s, {peak['best']})"
    if "vllm" in report:
        tandem, vllm = report["tandem"]["output_tok_per_s"], report["vllm"]["output_tok_per_s"]
        target = min(TARGET_RATIO * vllm, TARGET_CEILING_FRACTION * ceil["output_tok_per_s"])
        ids_t, ids_v = report["tandem"]["output_token_ids"], report["vllm"]["output_token_ids"]
        report["result"] = {
            "tandem_over_vllm": tandem / vllm,
            "target_output_tok_per_s": target,
            "target_met": tandem >= target and tandem > vllm,
            "same_tokens_fraction": sum(a == b for a, b in zip(ids_t, ids_v)) / len(workload),
        }
        line += f"; tandem / vllm {tandem / vllm:.2f}x (target {target:.1f} tok/s: "
        line += "met)" if report["result"]["target_met"] else "not met)"
    print(line)
    tandem_run = report["tandem"]
    kv_bytes, weight_bytes = tandem_run["kv_element_bytes"], tandem_run["weight_element_bytes"]
    print("tandem " + decode_line(tandem_run["phases"], shape, peak["gflops"], kv_bytes, memory["gbps"], weight_bytes))
    for side in ("vllm", "tandem"):
        if side in report:
            report[side].pop("output_token_ids", None)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
