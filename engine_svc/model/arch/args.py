"""ModelArgs: the shape and options of one decoder, read from ``config.json``.

Every family the engine serves (``families.py``) runs the same decoder (``llama.py``) with
options set here: q/k biases, per-head q/k norms, the MLP's activation, a mixture of
experts in place of the MLP, and a sliding window per layer. A config field the engine
cannot honour is refused with a ``ValueError`` that names it, before any weight loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine_svc.model.arch.families import family_options
from engine_svc.model.arch.rope_config import rope_config

# config.json's hidden_act -> the gated MLP's activation (layers.py ACTIVATIONS).
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor": ..., ...}; None = default
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"  # the gated MLP's activation
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    # Per layer: the attention window (keys in (pos - window, pos]) or None for full attention.
    sliding_windows: tuple[int | None, ...] = ()
    # Mixture of experts (0 experts = a dense MLP on every layer).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities to sum to 1
    moe_layers: tuple[bool, ...] = ()  # per layer: experts (True) or the dense MLP
    # Gemma 3: every norm scales by (norm_offset + w); embeddings scaled by embed_scale; norms
    # on the attention and MLP outputs too (sandwich_norms); sliding layers with their own theta.
    norm_offset: float = 0.0
    embed_scale: float | None = None
    sandwich_norms: bool = False
    attn_scale: float | None = None  # None: head_dim ** -0.5
    sliding_rope_theta: float | None = None  # None: sliding layers rotate as the full ones do
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    partial_rotary_factor: float = 1.0  # RoPE rotates the first rotary_dim of each head (Phi-4-mini: 0.75)

    def __post_init__(self) -> None:
        if not self.sliding_windows:
            self.sliding_windows = (None,) * self.num_layers
        if not self.moe_layers:
            self.moe_layers = (self.num_experts > 0,) * self.num_layers
        if len(self.sliding_windows) != self.num_layers or len(self.moe_layers) != self.num_layers:
            raise ValueError(f"{self.architecture}: layer_types must list one entry per layer ({self.num_layers})")
        if len({w for w in self.sliding_windows if w is not None}) > 1:
            raise ValueError(f"sliding_window: one window size for all sliding layers, got {self.sliding_windows}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"hidden_act {self.hidden_act!r} is not supported; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok {self.num_experts_per_tok} must be between 1 and num_experts {self.num_experts}"
            )

    @classmethod
    def from_hf_config(cls, config: dict) -> ModelArgs:
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x layout)."""
        num_heads = config["num_attention_heads"]
        hidden_size = config["hidden_size"]
        rope_theta, rope_scaling = rope_config(config)
        num_layers = config["num_hidden_layers"]
        base = dict(
            vocab_size=config["vocab_size"],
            hidden_size=hidden_size,
            intermediate_size=config["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or hidden_size // num_heads,
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            hidden_act=config.get("hidden_act") or config.get("hidden_activation") or "silu",
            partial_rotary_factor=float(
                (config.get("rope_parameters") or {}).get("partial_rotary_factor")
                or config.get("partial_rotary_factor")
                or 1.0
            ),
        )
        family: dict[str, Any] = dict(family_options(config))  # typed where it is written (FamilyOptions)
        return cls(**(base | family))

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def sliding_window(self) -> int | None:
        """The window of the sliding-window layers (one size for all), None when there are none."""
        return next((w for w in self.sliding_windows if w is not None), None)

    def check_max_model_len(self, max_model_len: int) -> None:
        """Refuse a context the model would compute differently than we do. Sliding windows
        are applied per layer; LongRoPE is not: transformers switches a sequence from
        ``short_factor`` to ``long_factor`` once it outgrows the original context, which
        would leave the cached keys of a longer request rotated by the other factors."""
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        scaling = self.rope_scaling or {}
        original = scaling.get("original_max_position_embeddings") or max_model_len
        if scaling.get("rope_type") == "longrope" and max_model_len > original:
            raise ValueError(
                f"rope_scaling longrope: contexts past original_max_position_embeddings ({original}) "
                f"switch to long_factor mid-request, which is not implemented; set max_model_len <= {original}"
            )
