"""Services and the in-process engine for ``benchmarks.serve``: ``--launch`` and ``--compare-inprocess``."""

from __future__ import annotations

import contextlib
import shlex
import time

from benchmarks.workloads import salted


def _engine_flags(args) -> list[str]:
    return [a for arg in args.engine_arg for a in shlex.split(arg)]


@contextlib.contextmanager
def launched(args, extra_frontend_args: tuple[str, ...] = ()):
    """Starts ``--engines`` engines and a frontend over them on free local ports
    (tests/services.py), yields (engines, frontend) once all serve, and stops them all."""
    from engine_svc.demo_model import ensure_demo_model
    from tests.services import start_engine, start_frontend

    model = args.model or ensure_demo_model()
    engines = [start_engine(model, *_engine_flags(args)) for _ in range(args.engines)]
    frontend = None
    try:
        for engine in engines:
            engine.wait_serving(timeout=600)
        extra = (*(a for f in args.frontend_arg for a in shlex.split(f)), *extra_frontend_args)
        frontend = start_frontend(*(e.address for e in engines), extra=extra)
        frontend.wait_serving(timeout=120)
        yield engines, frontend
    finally:
        if frontend is not None:
            frontend.terminate()
        for engine in engines:
            engine.terminate()


def run_inprocess(args, workload: list[dict], vocab_size: int) -> dict:
    """The same workload through EngineCore.generate in this process, all at once."""
    from engine_svc.config import EngineConfig, build_parser
    from engine_svc.core import EngineCore
    from engine_svc.types import SamplingParams

    t0 = time.perf_counter()
    argv = (["--model", str(args.model)] if args.model else []) + _engine_flags(args)
    config = EngineConfig.from_args(build_parser().parse_args(argv))
    if config.num_threads:  # as engine_svc.__main__ does
        import torch

        torch.set_num_threads(config.num_threads)
    core = EngineCore(config)
    core.warmup()
    # An untimed pass (the pair had its warm-up calls), salted so it leaves nothing cached.
    warm = salted(workload, vocab_size - 1, vocab_size)
    core.generate([r["prompt_token_ids"] for r in warm], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    startup_s = time.perf_counter() - t0
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in workload]
    t0 = time.perf_counter()
    completions = core.generate([r["prompt_token_ids"] for r in workload], params)
    wall = time.perf_counter() - t0
    num_prompt = sum(len(r["prompt_token_ids"]) for r in workload)
    num_output = sum(len(c.output_token_ids) for c in completions)
    return {
        "wall_s": wall,
        "startup_s": startup_s,
        "num_output_tokens": num_output,
        "output_tok_per_s": num_output / wall,
        "total_tok_per_s": (num_prompt + num_output) / wall,
    }
