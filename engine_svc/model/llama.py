"""The decoder every family runs (families.py), in plain PyTorch.

One flattened batch of tokens goes through the model: ``[num_tokens, hidden]`` with no
batch dimension and no padding. Which request a token belongs to, and what it may attend
to, lives only in ``AttentionMetadata`` (engine_svc/model/attention/).

Families differ in options only (``ModelArgs``, args.py): biases, per-head q/k norms,
the MLP's activation, a sliding window per layer (layers.py), and a mixture of experts in
place of the MLP on some layers (moe.py).

At load time q/k/v are fused into one Linear and gate/up into another, so each layer runs
four matmuls instead of seven.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine_svc.model.args import ModelArgs
from engine_svc.model.attention import AttentionMetadata, KVCache
from engine_svc.model.layers import MLP, Attention, RMSNorm
from engine_svc.model.moe import SparseMoE
from engine_svc.model.rope import RotaryEmbedding, StepRope

logger = logging.getLogger(__name__)

__all__ = ["DecoderLayer", "ModelArgs", "Transformer"]


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = Attention(args, layer)
        self.post_attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp: nn.Module = SparseMoE(args) if args.moe_layers[layer] else MLP(args)

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
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
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
