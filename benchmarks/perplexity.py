"""Perplexity of a model on a text that ships with the repository, per weight format.

    python -m benchmarks.perplexity --model PATH [--quantization auto none int8 int4 auto+a8]
        [--text engine_svc/demo_corpus.txt] [--window 512] [--json OUT]

Each ``--quantization`` value is one engine (``--quantization`` as the engine takes it:
on a GGUF file ``none`` is its weights dequantized to float32, ``auto`` its blocks as they
are, ``int8`` / ``int4`` the dequantized weights quantized again at load; ``+a8`` adds
``--activation-quantization int8``, ``+a32`` ``none``). The text is
tokenized with the model's tokenizer and cut into windows of ``--window`` tokens; the
perplexity is exp of the mean negative log-likelihood of every token after the first of
each window (the engine's prompt logprobs, float32). Prints one line per format and its
change against the first.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from benchmarks.quant_engine import ACTIVATIONS
from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.types import SamplingParams


def windows(token_ids: list[int], size: int) -> list[list[int]]:
    return [token_ids[i : i + size] for i in range(0, len(token_ids) - 1, size) if len(token_ids[i : i + size]) > 1]


def perplexity(core: EngineCore, prompts: list[list[int]]) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
    nll, count = 0.0, 0
    for result in core.generate(prompts, params):
        for lp in result.prompt_logprobs:
            nll -= lp.logprob
            count += 1
    return math.exp(nll / count)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--quantization", nargs="+", default=["none", "auto", "int8", "int4"])
    p.add_argument("--text", default=str(Path(__file__).resolve().parent.parent / "engine_svc" / "demo_corpus.txt"))
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens of the text to score")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from tokenizers import Tokenizer

    rows = []
    for method in args.quantization:
        start = time.perf_counter()
        weights, _, a8 = method.partition("+")
        config = EngineConfig(
            model=args.model,
            dtype="float32",
            quantization=weights,
            activation_quantization=ACTIVATIONS[a8],
            num_kv_blocks=512,
        )
        core = EngineCore(config)
        tokenizer = Tokenizer.from_file(str(core.model_dir / "tokenizer.json"))
        token_ids = tokenizer.encode(Path(args.text).read_text()).ids[: args.max_tokens]
        ppl = perplexity(core, windows(token_ids, args.window))
        rows.append({"quantization": method, "matmuls": core.runner.matmuls, "ppl": ppl,
                     "num_tokens": len(token_ids), "seconds": time.perf_counter() - start})  # fmt: skip
        base = rows[0]["ppl"]
        change = f"{100 * (ppl / base - 1):+.2f}% vs {rows[0]['quantization']}"
        print(f"{method:>5} ({core.runner.matmuls}): ppl {ppl:.4f}  ({change})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
