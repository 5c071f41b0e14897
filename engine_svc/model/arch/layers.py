"""The decoder's shared layers, each with the options the families need.

    RMSNorm    ``offset``: scale by ``offset + w`` (Gemma's ``1 + w``) instead of ``w``
    Attention  q/k/v and o biases, per-head q/k RMSNorm (Qwen3), a sliding window per layer
    MLP        gated: ``down(act(gate(x)) * up(x))`` with ``act`` from ``ACTIVATIONS``

All run on one flattened batch ``[num_tokens, hidden]`` with no padding.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from engine_svc.model.arch.args import ModelArgs
from engine_svc.model.arch.rope import StepRope
from engine_svc.model.attention import AttentionMetadata, KVCache, paged_attention

# config.json's hidden_act -> the function transformers' ACT2FN maps it to.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


class RMSNorm(nn.Module):
    """RMSNorm of the residual stream: ``forward(x, residual)`` first adds the sublayer's
    output ``x`` to the stream (when there is one) and returns (normed, new stream)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.offset:
            # Gemma scales in float32 by (1 + w), then rounds once.
            return (normed * (self.offset + self.weight.float())).to(x.dtype), x
        # Normalise in float32 and scale in the model dtype, as transformers does.
        return self.weight * normed.to(x.dtype), x


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.num_heads = args.num_heads
        self.num_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        self.scale = args.attn_scale if args.attn_scale is not None else args.head_dim**-0.5
        self.sliding_window = args.sliding_windows[layer]  # None = full attention
        qkv_out = (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, qkv_out, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.num_heads * args.head_dim, args.hidden_size, bias=args.o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps, args.norm_offset)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps, args.norm_offset)

    def _qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [num_tokens, nh, hd], k [num_tokens, nkv, hd], each normed over hd."""
        assert self.q_norm is not None and self.k_norm is not None
        return self.q_norm(q)[0], self.k_norm(k)[0]

    def forward(self, x: torch.Tensor, rope: StepRope, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, (nh + 2 * nkv) * hd]
        qk_norm = self._qk_norm if self.q_norm is not None else None
        q, k, v = rope.split(qkv, self.num_heads, self.num_kv_heads, self.head_dim, qk_norm)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.sliding_window)  # [num_tokens, nh, hd]
        return self.o_proj(out.view(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, intermediate_size: int | None = None) -> None:
        super().__init__()
        intermediate = intermediate_size or args.intermediate_size
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * intermediate, bias=args.mlp_bias)
        self.down_proj = nn.Linear(intermediate, args.hidden_size, bias=args.mlp_bias)
        self.hidden_act = args.hidden_act
        self.act = ACTIVATIONS[args.hidden_act]
        # True once gate_up_proj is a layer that applies SiLU-and-multiply itself (native kernels).
        self.act_fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate], or [num_tokens, intermediate] when act_fused
        if not self.act_fused:
            gate, up = h.chunk(2, dim=-1)  # [num_tokens, intermediate] each
            h = self.act(gate) * up
        return self.down_proj(h)
