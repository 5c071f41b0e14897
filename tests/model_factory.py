"""Small random-weight Llama-family checkpoints for tests and benchmarks.

Models are built in code with ``transformers`` under a fixed seed and saved as a local
Hugging Face directory (config.json, safetensors, generation_config.json), so nothing is
ever downloaded. The defaults (initializer_range 0.1, untied embeddings) keep greedy
decoding from collapsing into one repeated token, which makes continuations a sharper
correctness check.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import transformers

logger = logging.getLogger(__name__)

_ARCHES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
}

BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2


def make_config(
    arch: str = "llama",
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None,
    initializer_range: float = 0.1,
) -> transformers.PretrainedConfig:
    """A ``transformers`` config for one of the supported architectures."""
    if arch not in _ARCHES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(_ARCHES)}")
    config_cls, _ = _ARCHES[arch]
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        rms_norm_eps=1e-6,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
    )
    if rope_scaling is not None:
        kwargs["rope_scaling"] = dict(rope_scaling)  # transformers edits it in place
    if arch == "mistral":
        kwargs["sliding_window"] = None  # full attention, like Mistral v0.2+
    return config_cls(**kwargs)


def make_model_dir(
    path: str | Path,
    arch: str = "llama",
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None,
    initializer_range: float = 0.1,
    seed: int = 0,
    shards: int = 1,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Build a random-weight model and save it as a HF directory at ``path``.

    ``shards > 1`` splits the weights into about that many safetensors files with a
    ``model.safetensors.index.json``. Returns the directory.
    """
    path = Path(path)
    config = make_config(
        arch,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_scaling=rope_scaling,
        initializer_range=initializer_range,
    )
    _, model_cls = _ARCHES[arch]
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    # HF initialises biases to zero; random ones make the bias mapping observable.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, initializer_range)

    save_kwargs: dict = {"safe_serialization": True}
    if shards > 1:
        total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        save_kwargs["max_shard_size"] = max(1, total_bytes // shards)
    model.save_pretrained(path, **save_kwargs)
    transformers.GenerationConfig(bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=0).save_pretrained(
        path
    )
    logger.info("built %s model at %s", arch, path)
    return path


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.float32) -> transformers.PreTrainedModel:
    """The ``transformers`` reference model for a directory built by ``make_model_dir``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()
