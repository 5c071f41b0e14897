"""A GGUF file written out as a float Hugging Face directory, for engines that read no GGUF.

    python -m benchmarks.gguf_to_hf SRC.gguf OUT_DIR [--dtype float32]
    python -m benchmarks.gguf_to_hf --demo OUT_DIR        # the SmolLM2-135M-Instruct demo GGUF

``benchmarks.vs_vllm`` compares engines on one checkpoint; vLLM's CPU build does not load
the demo's Q4_1 GGUF, so this writes the same weights, dequantized, where both engines read
them: ``config.json``, ``generation_config.json`` and the tokenizer files come from the
engine's own GGUF preparation (engine_svc/model/gguf_checkpoint.py: metadata converted by
gguf_metadata.py, tokenizer by transformers' GGUF converter), the weights from its GGUF
reader (gguf_weights.py: Hugging Face names, llama.cpp's q/k row permutation undone,
blocks dequantized with gguf's reference code) into one ``model.safetensors``. Tied
embeddings stay tied (no ``lm_head.weight``). Dequantized Q4_1 values are exact in float32,
so a float32 directory holds the GGUF's weights bit for bit; the engines cast them to
bfloat16 themselves when asked to serve that.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine_svc.model.args import ModelArgs
from engine_svc.model.gguf_checkpoint import SOURCE_FILE, prepare_gguf_dir
from engine_svc.model.gguf_weights import read_gguf_tensors

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def write_hf_dir(gguf_path: Path, out: Path, dtype: str = "float32") -> Path:
    prepared = prepare_gguf_dir(gguf_path)
    config = json.loads((prepared / "config.json").read_text())
    tensors, freq_factors = read_gguf_tensors(gguf_path, ModelArgs.from_hf_config(config))
    if freq_factors is not None:
        raise SystemExit(f"{gguf_path.name}: its rope_freqs have no place in a Hugging Face directory")
    out.mkdir(parents=True, exist_ok=True)
    for f in prepared.iterdir():
        if f.is_file() and f.name != SOURCE_FILE:
            shutil.copyfile(f, out / f.name)
    config["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    weights = {name: t.to(DTYPES[dtype]).contiguous() for name, t in tensors}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", nargs="?", help="the GGUF file (omit with --demo)")
    p.add_argument("out")
    p.add_argument("--demo", action="store_true", help="the demo's SmolLM2-135M-Instruct GGUF (fetched once)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    args = p.parse_args(argv)
    if args.demo == (args.src is not None):
        p.error("give a GGUF file or --demo, not both")
    if args.demo:
        from engine_svc.demo_checkpoint import fetch_demo_gguf

        src = fetch_demo_gguf()
    else:
        src = Path(args.src)
    out = write_hf_dir(src, Path(args.out), args.dtype)
    print(f"{src} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
