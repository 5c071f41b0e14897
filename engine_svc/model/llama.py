"""Llama-family decoder (Llama, Mistral, Qwen2) in plain PyTorch.

One flattened batch of tokens goes through the model: ``[num_tokens, hidden]`` with no
batch dimension and no padding. Which request a token belongs to, and what it may attend
to, lives only in ``AttentionMetadata`` (engine_svc/model/attention/).

Differences between the three architectures are config-level only:
  * Qwen2 has biases on q/k/v (``qkv_bias``); Llama may have biases everywhere
    (``attention_bias`` / ``mlp_bias``).
  * Mistral and Qwen2 may use sliding-window attention, which this model does not
    implement: ``ModelArgs.check_max_model_len`` refuses a window shorter than the context.

At load time q/k/v are fused into one Linear and gate/up into another, so each layer runs
four matmuls instead of seven.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine_svc.model.attention import AttentionMetadata, KVCache, paged_attention

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


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
    sliding_window: int | None = None  # None = full attention on every layer

    @classmethod
    def from_hf_config(cls, config: dict) -> ModelArgs:
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x layout)."""
        architecture = _architecture(config)
        num_heads = config["num_attention_heads"]
        hidden_size = config["hidden_size"]
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported; only 'silu' (SwiGLU)")
        rope_theta, rope_scaling = _rope_config(config)
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            architecture=architecture,
            vocab_size=config["vocab_size"],
            hidden_size=hidden_size,
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or hidden_size // num_heads,
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=architecture == "Qwen2ForCausalLM" or attention_bias,
            o_bias=architecture == "LlamaForCausalLM" and attention_bias,
            mlp_bias=architecture == "LlamaForCausalLM" and bool(config.get("mlp_bias", False)),
            sliding_window=_sliding_window(architecture, config),
        )

    def check_max_model_len(self, max_model_len: int) -> None:
        """Refuse a context the model would attend to differently than we compute."""
        if self.sliding_window is not None and self.sliding_window < max_model_len:
            raise ValueError(
                f"{self.architecture} uses sliding-window attention (window {self.sliding_window}), "
                f"which is not implemented; set max_model_len <= {self.sliding_window}"
            )


def _architecture(config: dict) -> str:
    archs = config.get("architectures") or []
    if not archs and config.get("model_type") in _MODEL_TYPE_TO_ARCH:
        archs = [_MODEL_TYPE_TO_ARCH[config["model_type"]]]
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    name = ", ".join(archs) or f"model_type={config.get('model_type')!r}"
    raise ValueError(f"unsupported architecture {name}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _rope_config(config: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from either ``rope_parameters`` (5.x) or ``rope_theta``/``rope_scaling`` (4.x)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope_scaling type {rope_type!r} is not implemented; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    params.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    return theta, params


def _sliding_window(architecture: str, config: dict) -> int | None:
    window = config.get("sliding_window")
    if window is None:
        return None
    if architecture == "Qwen2ForCausalLM":
        layer_types = config.get("layer_types") or []
        if not config.get("use_sliding_window", False) and "sliding_attention" not in layer_types:
            return None
    return int(window)


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32), computed as transformers does."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = args.rope_scaling
    if scaling is None:
        return inv_freq
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [num_tokens, heads, head_dim]; cos, sin: [num_tokens, 1, head_dim // 2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class StepRope:
    """RoPE for one step's positions, shared by every layer: cos, sin computed once."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos, self.sin = cos, sin  # [num_tokens, 1, head_dim // 2] in the model dtype

    def split(self, qkv: torch.Tensor, nh: int, nkv: int, hd: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [num_tokens, (nh + 2 * nkv) * hd] -> rotated q [num_tokens, nh, hd], rotated k and
        v [num_tokens, nkv, hd]."""
        num_tokens = qkv.shape[0]
        qk, v = qkv.split(((nh + nkv) * hd, nkv * hd), dim=-1)
        # q and k rotate together: one RoPE pass over nh + nkv heads.
        qk = apply_rope(qk.view(num_tokens, nh + nkv, hd), self.cos, self.sin)  # [num_tokens, nh + nkv, hd]
        q, k = qk.split((nh, nkv), dim=1)
        return q, k, v.view(num_tokens, nkv, hd)


class RotaryEmbedding(nn.Module):
    """Makes each step's ``StepRope`` from its positions."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        # [head_dim // 2] fp32, filled by the loader with rope_inv_freq(args) on the real device.
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[len(positions), head_dim // 2]`` in ``dtype``, computed in fp32 like transformers."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> StepRope:
        cos, sin = self.cos_sin(positions, dtype)
        return StepRope(cos.unsqueeze(1), sin.unsqueeze(1))


class RMSNorm(nn.Module):
    """RMSNorm of the residual stream: ``forward(x, residual)`` first adds the sublayer's
    output ``x`` to the stream (when there is one) and returns (normed, new stream)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        # Normalise in float32 and scale in the model dtype, as transformers does.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype), x


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_heads = args.num_heads
        self.num_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        qkv_out = (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, qkv_out, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.num_heads * args.head_dim, args.hidden_size, bias=args.o_bias)

    def forward(self, x: torch.Tensor, rope: StepRope, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, (nh + 2 * nkv) * hd]
        q, k, v = rope.split(qkv, self.num_heads, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)  # [num_tokens, nh, hd]
        return self.o_proj(out.view(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)
        # True once gate_up_proj is a layer that applies SiLU-and-multiply itself (native kernels).
        self.act_fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate], or [num_tokens, intermediate] when act_fused
        if not self.act_fused:
            gate, up = h.chunk(2, dim=-1)  # [num_tokens, intermediate] each
            h = F.silu(gate) * up
        return self.down_proj(h)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.input_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = Attention(args)
        self.post_attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: StepRope,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous sublayer's output; residual: the stream it adds to (None before the
        first layer, where x is the embedding). Returns (this layer's MLP output, stream)."""
        h, residual = self.input_norm(x, residual)
        h, residual = self.post_attn_norm(self.attn(h, rope, kv_cache, meta), residual)
        return self.mlp(h), residual


class Transformer(nn.Module):
    """Decoder stack plus LM head. ``forward`` stops before the head so the caller can
    pick the few rows that need logits (``compute_logits``).

    Built without initial values (the loader builds it on the meta device, then assigns
    the checkpoint's tensors)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        # An explicit weight skips nn.Embedding's random init: on the meta device that (like
        # any arithmetic there) runs torch's Python reference ops, which import torch._dynamo
        # (2.5 s of start-up).
        self.embed_tokens = nn.Embedding(
            args.vocab_size, args.hidden_size, _weight=torch.empty(args.vocab_size, args.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.rotary: nn.Module = RotaryEmbedding(args.head_dim)  # makes each step's StepRope

    def tie_weights(self) -> None:
        self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final-normed hidden states [num_tokens, hidden]."""
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        rope = self.rotary(positions, x.dtype)  # once per step, for every layer
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_rows, hidden] -> logits [num_rows, vocab] in the model dtype."""
        return self.lm_head(hidden)
