"""A GGUF file written out as a float Hugging Face directory, for engines that read no GGUF.

    python -m benchmarks.gguf_to_hf SRC.gguf OUT_DIR [--dtype float32]
    python -m benchmarks.gguf_to_hf --demo OUT_DIR        # the SmolLM2-135M-Instruct demo GGUF
    python -m benchmarks.gguf_to_hf --demo OUT_DIR --w8a8 # its linear layers as W8A8 (below)

``benchmarks.vs_vllm`` compares engines on one checkpoint; vLLM's CPU build does not load
the demo's Q4_1 GGUF, so this writes the same weights, dequantized, where both engines read
them: ``config.json``, ``generation_config.json`` and the tokenizer files come from the
engine's own GGUF preparation (engine_svc/model/load/gguf_checkpoint.py: metadata converted by
model/load/gguf_metadata.py, tokenizer by transformers' GGUF converter), the weights from its GGUF
reader (model/load/gguf_weights.py: Hugging Face names, llama.cpp's q/k row permutation undone,
blocks dequantized with gguf's reference code) into one ``model.safetensors``. Tied
embeddings stay tied (no ``lm_head.weight``). Dequantized Q4_1 values are exact in float32,
so a float32 directory holds the GGUF's weights bit for bit; the engines cast them to
bfloat16 themselves when asked to serve that.

``--w8a8`` writes the linear layers (not the embedding and LM head) as compressed-tensors
W8A8, the int8 scheme vLLM's CPU build runs: int8 weights with one float32 scale per
output row (symmetric, round to nearest), int8 activations quantized per token at run
time (format ``int-quantized``): one checkpoint both engines serve, vLLM with bfloat16
activations quantized per token, Tandem keeping the integers with its own int8
activations (per group of 32 along K) where the CPU has int8 dot products.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine_svc.model.arch.args import ModelArgs
from engine_svc.model.load.gguf_checkpoint import SOURCE_FILE, prepare_gguf_dir
from engine_svc.model.load.gguf_weights import read_gguf_tensors

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


W8A8_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "token",
                "dynamic": True,
            },
        }
    },
    "ignore": ["lm_head"],
}


def to_w8a8(out: Path) -> Path:
    """A directory ``write_hf_dir`` wrote, its ``*_proj.weight`` tensors rewritten as int8
    with per-row ``weight_scale`` and the compressed-tensors W8A8 config (module docstring)."""
    weights = load_file(str(out / "model.safetensors"))
    for name in [n for n in weights if n.endswith("_proj.weight")]:
        w = weights[name].float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        weights[name] = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
        weights[name.removesuffix(".weight") + ".weight_scale"] = scale
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = W8A8_CONFIG
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", nargs="?", help="the GGUF file (omit with --demo)")
    p.add_argument("out")
    p.add_argument("--demo", action="store_true", help="the demo's SmolLM2-135M-Instruct GGUF (fetched once)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--w8a8", action="store_true", help="linear layers as compressed-tensors W8A8 (vLLM's int8)")
    args = p.parse_args(argv)
    if args.demo == (args.src is not None):
        p.error("give a GGUF file or --demo, not both")
    if args.demo:
        from engine_svc.demo_checkpoint import fetch_demo_gguf

        src = fetch_demo_gguf()
    else:
        src = Path(args.src)
    out = write_hf_dir(src, Path(args.out), args.dtype)
    if args.w8a8:
        to_w8a8(out)
    print(f"{src} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
