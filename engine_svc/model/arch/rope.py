"""Rotary position embeddings: inverse frequencies per rope type, and each step's cos/sin.

The rope types (``rope_config.SUPPORTED_ROPE_TYPES``) differ only in ``rope_inv_freq``; the
rotation is rotate-half everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from engine_svc.model.arch.args import ModelArgs

# Applied to q and k [num_tokens, heads, hd] before they rotate (Qwen3's per-head norms).
QKNorm = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def rope_inv_freq(args: ModelArgs, *, sliding: bool = False) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32), computed as transformers does; with
    ``sliding``, those of the sliding-window layers where they have their own theta (unscaled)."""
    dim = args.rotary_dim
    theta = args.sliding_rope_theta if sliding and args.sliding_rope_theta is not None else args.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if sliding and args.sliding_rope_theta is not None:
        return inv_freq
    scaling = args.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":  # positions divided by factor
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "longrope":
        # Contexts up to original_max_position_embeddings (check_max_model_len holds us there).
        ext = torch.tensor(scaling["short_factor"], dtype=torch.float32)
        return 1.0 / (ext * args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
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


def rope_attention_scaling(args: ModelArgs) -> float:
    """The factor transformers multiplies cos and sin by (LongRoPE's attention_factor; else 1)."""
    scaling = args.rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first ``rotary_dim = 2 * cos.shape[-1]`` of each head (the rest
    passes through). x: [num_tokens, heads, head_dim]; cos, sin: [num_tokens, 1, rotary_dim // 2]."""
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class StepRope:
    """RoPE for one step's positions, shared by every layer: cos, sin computed once."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos, self.sin = cos, sin  # [num_tokens, 1, head_dim // 2] in the model dtype

    def split(
        self, qkv: torch.Tensor, nh: int, nkv: int, hd: int, qk_norm: QKNorm | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [num_tokens, (nh + 2 * nkv) * hd] -> rotated q [num_tokens, nh, hd], rotated k and
        v [num_tokens, nkv, hd]; ``qk_norm`` runs on q and k before they rotate."""
        num_tokens = qkv.shape[0]
        qk, v = qkv.split(((nh + nkv) * hd, nkv * hd), dim=-1)
        qk = qk.view(num_tokens, nh + nkv, hd)
        if qk_norm is not None:
            q, k = qk_norm(*qk.split((nh, nkv), dim=1))
            qk = torch.cat((q, k), dim=1)
        # q and k rotate together: one RoPE pass over nh + nkv heads.
        qk = apply_rope(qk, self.cos, self.sin)  # [num_tokens, nh + nkv, hd]
        q, k = qk.split((nh, nkv), dim=1)
        return q, k, v.view(num_tokens, nkv, hd)


class RotaryEmbedding(nn.Module):
    """Makes each step's ``StepRope`` from its positions."""

    inv_freq: torch.Tensor

    def __init__(self, rotary_dim: int) -> None:
        super().__init__()
        # [rotary_dim // 2] fp32, filled by the loader with rope_inv_freq(args) on the real device.
        self.register_buffer("inv_freq", torch.empty(rotary_dim // 2), persistent=False)
        self.attention_scaling = 1.0  # set by the loader: rope_attention_scaling(args)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[len(positions), head_dim // 2]`` in ``dtype``, computed in fp32 like transformers."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        if self.attention_scaling != 1.0:
            return (freqs.cos() * self.attention_scaling).to(dtype), (freqs.sin() * self.attention_scaling).to(dtype)
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> StepRope:
        cos, sin = self.cos_sin(positions, dtype)
        return StepRope(cos.unsqueeze(1), sin.unsqueeze(1))
