"""Write the benchmark model: a random-weight Llama with SmolLM-135M shapes, vocab 8192.

    python -m benchmarks.make_model DIR [--vocab-size N]

Shapes: hidden 576, intermediate 1536, 30 layers, 9 heads, 3 KV heads, tied embeddings.
A byte-level BPE tokenizer of exactly ``N`` ids (``<unk>``, ``<s>``, ``</s>`` first) is
written beside the weights, so the frontend can serve the model too. At 8192 it is trained
on the demo corpus and padded with unused tokens; above, on text generated in code
(``benchmarks/corpus.py``, ~1 MB per 2k ids), so that a 32k or 128k vocabulary is made of
real merges, as the token masks of structured output see a real model's.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def make_benchmark_model(out_dir: str | Path, *, seed: int = 0, vocab_size: int = 8192) -> Path:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(out)
    write_tokenizer(out, config.vocab_size)
    return out


def write_tokenizer(out: Path, vocab_size: int) -> None:
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.trainers import BpeTrainer

    from benchmarks.corpus import lines
    from engine_svc.demo_model import _CORPUS_PATH

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = _CORPUS_PATH.read_text(encoding="utf-8").splitlines()
    if vocab_size > 8192:
        text += lines(vocab_size * 500)
    tokenizer.train_from_iterator(text, trainer=trainer)
    # The corpus is too small for 8192 merges: fill the rest so every model id decodes.
    missing = vocab_size - tokenizer.get_vocab_size()
    tokenizer.add_tokens([f"<|unused_{i}|>" for i in range(missing)])
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": False,
                "model_max_length": 2048,
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            indent=2,
        )
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir")
    p.add_argument("--vocab-size", type=int, default=8192, help="e.g. 32768 for a large-vocabulary run")
    args = p.parse_args(argv)
    print(f"benchmark model in {make_benchmark_model(args.dir, vocab_size=args.vocab_size)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
