"""Write the MoE benchmark pair: a small Mixtral and a dense model of the same active size.

    python -m benchmarks.make_moe_model DIR

``DIR/moe``: Mixtral, hidden 512, 8 experts of intermediate 1024, top-2, 8 layers, vocab
8192. ``DIR/dense``: Mistral with the same attention and an MLP of intermediate 2048, so a
token's MLP arithmetic (two experts of 1024) is the same in both; only the router and the
experts' grouping differ. Random weights (initializer_range 0.1), untied embeddings.
"""

from __future__ import annotations

import argparse
from pathlib import Path

COMMON = dict(
    vocab_size=8192,
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    initializer_range=0.1,
    tie_word_embeddings=False,
    sliding_window=None,
    bos_token_id=1,
    eos_token_id=2,
)


def make_moe_pair(out_dir: str | Path, *, seed: int = 0) -> tuple[Path, Path]:
    import torch
    from transformers import GenerationConfig, MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM

    out = Path(out_dir)
    made = []
    for name, config in (
        ("moe", MixtralConfig(**COMMON, intermediate_size=1024, num_local_experts=8, num_experts_per_tok=2)),
        ("dense", MistralConfig(**COMMON, intermediate_size=2048)),
    ):
        path = out / name
        if not (path / "config.json").exists():
            torch.manual_seed(seed)
            model_cls = MixtralForCausalLM if name == "moe" else MistralForCausalLM
            model_cls(config).save_pretrained(path)
            GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(path)
        made.append(path)
    return made[0], made[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    for path in make_moe_pair(p.parse_args().out_dir):
        print(path)


if __name__ == "__main__":
    main()
