"""Runs one token-id workload through vLLM's offline ``LLM.generate``; writes its figures as JSON.

    VLLM_PYTHON benchmarks/vllm_driver.py --model DIR --workload FILE --dtype D --out OUT.json

Started by ``benchmarks.vs_vllm`` with the interpreter of an environment that has vLLM
(vLLM is not a dependency of this project), so it imports nothing of the project: only
the standard library and vLLM. The code sits under the ``__main__`` guard because vLLM
starts its engine processes with spawn, which re-imports this file.

Same rules as the Tandem side: every request at once, greedy, ``ignore_eos``, each with
its own ``max_tokens``, prefix caching on, eager mode (vLLM's compiled mode takes minutes
to start on a small CPU and measured no faster), outputs not detokenized (the Tandem
engine hands out token ids too; text is its frontend's job). One short untimed request
with its own ids warms the engine up first.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--workload", required=True, help="JSON lines: prompt_token_ids, max_tokens")
    p.add_argument("--dtype", required=True)
    p.add_argument("--max-requests", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: vLLM's own")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    with open(args.workload) as f:
        workload = [json.loads(line) for line in f if line.strip()]
    if args.max_requests:
        workload = workload[: args.max_requests]

    t0 = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enable_prefix_caching=True,
        enforce_eager=True,
        seed=0,
        **({} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}),
    )
    startup_s = time.perf_counter() - t0
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=[3, 5, 7, 11, 13, 17, 19, 23])], warm, use_tqdm=False)

    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in workload]
    params = [
        SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False) for r in workload
    ]
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    expected = sum(r["max_tokens"] for r in workload)
    cached = sum(o.num_cached_tokens or 0 for o in outputs)
    sched = llm.llm_engine.vllm_config.scheduler_config
    result = {
        "engine": "vllm",
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "dtype": args.dtype,
        "num_requests": len(workload),
        "num_output_tokens": num_output,
        "num_output_tokens_expected": expected,
        "num_cached_prompt_tokens": cached,
        "wall_s": wall,
        "output_tok_per_s": num_output / wall,
        "startup_s": startup_s,
        "import_s": import_s,
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "output_token_ids": [list(o.outputs[0].token_ids) for o in outputs],
    }
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
