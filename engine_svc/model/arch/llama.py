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
from typing import Protocol

import torch
from torch import nn

from engine_svc.model.arch.args import ModelArgs
from engine_svc.model.arch.layers import MLP, Attention, RMSNorm
from engine_svc.model.arch.moe import SparseMoE
from engine_svc.model.arch.rope import RotaryEmbedding, StepRope
from engine_svc.model.attention import AttentionMetadata, KVCache

logger = logging.getLogger(__name__)

__all__ = ["DecoderLayer", "LayerStack", "ModelArgs", "Transformer"]


class LayerStack(Protocol):
    """Every decoder layer of some steps at once (backends/decode_stack.py)."""

    def takes(self, x: torch.Tensor, meta: AttentionMetadata) -> bool: ...

    def run(
        self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        eps, offset = args.rms_norm_eps, args.norm_offset
        self.sliding = args.sliding_windows[layer] is not None
        self.input_norm = RMSNorm(args.hidden_size, eps, offset)
        self.attn = Attention(args, layer)
        self.post_attn_norm = RMSNorm(args.hidden_size, eps, offset)
        self.mlp: nn.Module = SparseMoE(args) if args.moe_layers[layer] else MLP(args)
        # Sandwich norms (Gemma 3): post_attn_norm norms the attention output alone, then
        # pre_ff_norm adds it to the stream and norms that; post_ff_norm norms the MLP output.
        self.pre_ff_norm: RMSNorm | None = None
        self.post_ff_norm: RMSNorm | None = None
        if args.sandwich_norms:
            self.pre_ff_norm = RMSNorm(args.hidden_size, eps, offset)
            self.post_ff_norm = RMSNorm(args.hidden_size, eps, offset)

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
        if self.pre_ff_norm is None or self.post_ff_norm is None:
            h, residual = self.post_attn_norm(self.attn(h, rope, kv_cache, meta), residual)
            return self.mlp(h), residual
        h = self.post_attn_norm(self.attn(h, rope, kv_cache, meta))[0]
        h, residual = self.pre_ff_norm(h, residual)
        return self.post_ff_norm(self.mlp(h))[0], residual


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
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_offset)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.rotary: nn.Module = RotaryEmbedding(args.rotary_dim)  # makes each step's StepRope
        # The sliding-window layers' own RoPE (Gemma 3's local theta); None: they share ``rotary``.
        self.sliding_rotary: nn.Module | None = None
        # Every layer of a decode-only step in one native call (backends/decode_stack.py), where the
        # model qualifies; None: the layers run one by one.
        self.decode_stack: LayerStack | None = None
        if args.sliding_rope_theta is not None:
            self.sliding_rotary = RotaryEmbedding(args.rotary_dim)

    def tie_weights(self) -> None:
        self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final-normed hidden states [num_tokens, hidden]."""
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        if self.args.embed_scale is not None:
            # Rounded to the model dtype first, as transformers does.
            x = x * torch.tensor(self.args.embed_scale, dtype=x.dtype)
        if self.decode_stack is not None and self.decode_stack.takes(x, meta):
            out, stream = self.decode_stack.run(x, positions, kv_caches, meta)
            return self.norm(out, stream)[0]
        rope = self.rotary(positions, x.dtype)  # once per step, for every layer
        sliding_rope = rope if self.sliding_rotary is None else self.sliding_rotary(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, sliding_rope if layer.sliding else rope, kv_cache, meta)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_rows, hidden] -> logits [num_rows, vocab] in the model dtype."""
        logits = self.lm_head(hidden)
        cap = self.args.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
