"""Write the benchmark model: a random-weight Llama with SmolLM-135M shapes, vocab 8192.

    python -m benchmarks.make_model DIR [--dtype float32]

Shapes: hidden 576, intermediate 1536, 30 layers, 9 heads, 3 KV heads, tied embeddings.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def make_benchmark_model(out_dir: str | Path, *, seed: int = 0) -> Path:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    config = LlamaConfig(
        vocab_size=8192, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=True, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir")
    args = p.parse_args(argv)
    print(f"benchmark model in {make_benchmark_model(args.dir)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
