"""Speculative decoding's exactness under preemption, registered in benchmarks.abuse.

    spec-bf16   24 requests on a bfloat16 random model whose KV cache is too small for them
                (every request preempted and recomputed, at other moments with drafts than
                without): how many greedy and seeded outputs speculation changes, with
                prompt lookup and with a draft model (the target itself)

It runs the engine in-process (``EngineCore.generate``, the API an older checkout has
too), beside the pair benchmarks.abuse starts, which it does not use: copy this file into
an older checkout's benchmarks/ to count there.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

VOCAB = 512
NUM_REQUESTS = 24
SETTINGS = {"dtype": "bfloat16", "num_kv_blocks": 24, "block_size": 16, "max_num_seqs": 64}


def _count(model: Path) -> str:
    from engine_svc.config import EngineConfig
    from engine_svc.core import EngineCore
    from engine_svc.sched.spec import SpeculativeConfig
    from engine_svc.types import SamplingParams

    prompts = [[random.Random(8 + i).randrange(3, VOCAB) for _ in range(20 + i % 20)] for i in range(NUM_REQUESTS)]
    sampling = {
        "greedy": [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)] * NUM_REQUESTS,
        "seeded": [
            SamplingParams(temperature=0.3, seed=100 + i, max_tokens=48, ignore_eos=True) for i in range(NUM_REQUESTS)
        ],
    }
    methods = {
        "prompt lookup": SpeculativeConfig(
            num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3, adaptive=False
        ),
        "draft model": SpeculativeConfig(
            method="draft_model", model=str(model), num_speculative_tokens=3, adaptive=False
        ),
    }

    def outputs(params, spec) -> tuple[list[list[int]], int]:
        core = EngineCore(EngineConfig(model=str(model), speculative_config=spec, **SETTINGS))
        completions = core.generate(prompts, params)
        return [c.output_token_ids for c in completions], core.scheduler.num_preemptions

    parts, preemptions = [], 0
    for kind, params in sampling.items():
        off, n = outputs(params, None)
        preemptions += n
        for method, spec in methods.items():
            on, n = outputs(params, spec)
            preemptions += n
            parts.append(f"{kind} {method} {sum(a != b for a, b in zip(on, off))}")
    return f"outputs changed of {NUM_REQUESTS}: " + ", ".join(parts) + f" ({preemptions} preemptions in all)"


async def spec_bf16(_pair, _stub) -> str:
    from tests.model_factory import make_model_dir

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model_dir(Path(tmp) / "model", vocab_size=VOCAB, seed=1)
        result = _count(model)
    return f"{result}; {time.monotonic() - t0:.0f} s"


SCENARIOS = {"spec-bf16": spec_bf16}
