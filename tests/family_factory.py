"""Small random-weight checkpoints of every model family the engine serves.

Each is built with the family's own ``transformers`` config class under a fixed seed and
saved with ``save_pretrained``, so nothing is downloaded. The shapes exercise what sets
the family apart: a window smaller than the test prompts for sliding-window models,
several experts with top-2 routing, a dense layer among MoE ones, untied embeddings,
initializer_range 0.1 so greedy decoding does not collapse into one repeated token.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import transformers

from tests.model_factory import BOS_TOKEN_ID, EOS_TOKEN_ID

logger = logging.getLogger(__name__)

VOCAB_SIZE = 256
WINDOW = 24  # shorter than most test prompts

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=512,
    initializer_range=0.1,
    tie_word_embeddings=False,
    bos_token_id=BOS_TOKEN_ID,
    eos_token_id=EOS_TOKEN_ID,
    pad_token_id=0,
)

FAMILIES: dict[str, tuple[type, type, dict]] = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=16, attention_bias=True)),
    "qwen3_sliding": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(head_dim=16, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
    "mistral_sliding": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=WINDOW)),
    "qwen2_sliding": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0),
    ),
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=WINDOW),
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            head_dim=16,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=False,
            mlp_only_layers=[0],
        ),
    ),
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            head_dim=16,
            query_pre_attn_scalar=32,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=WINDOW,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
    ),
    # Phi-3 mini 128k's shape of RoPE: LongRoPE, contexts within the original length.
    "phi3": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        dict(
            max_position_embeddings=1024,
            original_max_position_embeddings=256,
            sliding_window=WINDOW,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
                "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0, 40.0],
            },
        ),
    ),
    # Phi-4-mini's: a quarter of each head passes RoPE by (partial_rotary_factor 0.75).
    "phi4_mini": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        dict(
            max_position_embeddings=1024,
            original_max_position_embeddings=256,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0],
                "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
            },
        ),
    ),
}


def make_family_dir(path: str | Path, family: str, *, seed: int = 0, **overrides) -> Path:
    """Build ``family``'s random-weight model and save it as a HF directory at ``path``."""
    config_cls, model_cls, options = FAMILIES[family]
    config = config_cls(**(_COMMON | options | overrides))
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):  # HF initialises biases to zero; random ones are observable
                param.normal_(0.0, 0.1)
            elif "norm" in name:  # norms start at ones; random gains make them observable
                param.normal_(1.0, 0.2)
    path = Path(path)
    model.save_pretrained(path)
    transformers.GenerationConfig(bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=0).save_pretrained(
        path
    )
    logger.info("built %s model at %s", family, path)
    return path
