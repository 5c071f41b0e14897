"""What requests with long stop-token and logit-bias lists cost the engine's other requests.

    python -m benchmarks.long_lists [--model DIR] [--list-len 2048] [--num-heavy 16] [--json OUT]

Two in-process runs of the same engine, each a batch of greedy ignore_eos decodes:

* baseline: ``2 x num_heavy`` plain requests;
* heavy: ``num_heavy`` plain requests plus ``num_heavy`` that each carry ``list-len``
  stop token ids, as many logit_bias entries, and a min_tokens that keeps the stop ids
  masked for the whole run (the case where the sampler reads the stop list every step).

The two runs alternate ``--repeats`` times and each keeps its fastest (on a busy machine
the others are noise). It prints the mean step time of both, wall and process CPU, and
their ratios; with the lists turned into tensors once per request the ratios stay near
1. No timing is asserted anywhere: the figures depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import random
import time


def _run(core, heavy: bool, args) -> dict:
    from engine_svc.types import SamplingParams

    rng = random.Random(0)
    vocab = core.vocab_size
    plain = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    lists = SamplingParams(
        max_tokens=args.output_len,
        min_tokens=args.output_len,
        temperature=0.0,
        ignore_eos=True,
        stop_token_ids=[rng.randrange(vocab) for _ in range(args.list_len)],
        logit_bias={t: -0.5 for t in rng.sample(range(vocab), min(args.list_len, vocab))},
    )
    prompts = [[rng.randrange(vocab) for _ in range(16)] for _ in range(2 * args.num_heavy)]
    params = [plain] * args.num_heavy + [lists if heavy else plain] * args.num_heavy
    steps_before = core.num_steps
    start, cpu_start = time.perf_counter(), time.process_time()
    core.generate(prompts, params)
    wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    num_steps = core.num_steps - steps_before
    return {
        "wall_s": wall_s,
        "num_steps": num_steps,
        "step_ms": 1000 * wall_s / num_steps,
        "step_cpu_ms": 1000 * cpu_s / num_steps,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.long_lists", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: the demo model)")
    p.add_argument("--list-len", type=int, default=2048, help="stop token ids and logit_bias entries per heavy request")
    p.add_argument("--num-heavy", type=int, default=16, help="requests with long lists (as many plain ones run along)")
    p.add_argument("--output-len", type=int, default=64, help="tokens each request generates")
    p.add_argument("--repeats", type=int, default=3, help="runs of each kind, alternating; the fastest counts")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)

    from engine_svc.config import EngineConfig
    from engine_svc.core import EngineCore

    core = EngineCore(EngineConfig(model=args.model, num_kv_blocks=1024, max_num_seqs=4 * args.num_heavy))
    core.warmup()
    _run(core, False, args)  # warm the allocator and the kernels up
    runs: dict[str, list[dict]] = {"baseline": [], "heavy": []}
    for _ in range(args.repeats):
        runs["baseline"].append(_run(core, False, args))
        runs["heavy"].append(_run(core, True, args))
    result: dict = {name: min(r, key=lambda x: x["step_ms"]) for name, r in runs.items()}
    for key in ("step_ms", "step_cpu_ms"):
        result[f"heavy_over_baseline_{key}"] = result["heavy"][key] / result["baseline"][key]
    result["list_len"], result["num_heavy"] = args.list_len, args.num_heavy
    for name in ("baseline", "heavy"):
        r = result[name]
        print(f"{name:9s} {r['step_ms']:.2f} ms/step wall, {r['step_cpu_ms']:.2f} ms/step CPU ({r['num_steps']} steps)")
    print(
        f"heavy / baseline: {result['heavy_over_baseline_step_ms']:.2f} wall, "
        f"{result['heavy_over_baseline_step_cpu_ms']:.2f} CPU"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
