"""Rotary position embeddings: inverse frequencies per rope type, and each step's cos/sin.

The rope types (``args.SUPPORTED_ROPE_TYPES``) differ only in ``rope_inv_freq``; the
rotation is rotate-half everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from engine_svc.model.args import ModelArgs

# Applied to q and k [num_tokens, heads, hd] before they rotate (Qwen3's per-head norms).
QKNorm = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


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
