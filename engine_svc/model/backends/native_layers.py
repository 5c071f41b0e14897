"""The model's layers on the native CPU kernels (engine_svc/model/native), swapped in at load.

    install_native_layers(model, kernels, dtype)    replaces, in place and all at once:
        RMSNorm          -> NativeRMSNorm      one pass: residual add + norm + gain
        RotaryEmbedding  -> NativeRotary       RoPE in place on the fused qkv, cos/sin from a table
    install_native_linears(model, kernels, dtype)
        nn.Linear        -> NativeLinear       weights packed for gemm.c;
                                               MLP gate/up fused with SiLU-and-multiply
        SparseMoE        .run_expert -> NativeExperts: each expert's two GEMMs packed alike

Whether the linear layers run here, in oneDNN or in ``F.linear`` is ``backend.py``'s
decision.

Each replacement computes what the module it replaces computes, with the same roundings
(tests/engine/model/native/test_native_kernels.py holds them to that). Attention over the paged cache
is chosen per step by ``AttentionMetadata`` (engine_svc/model/attention/).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine_svc.model.arch.layers import MLP, RMSNorm
from engine_svc.model.arch.llama import Transformer
from engine_svc.model.arch.moe import SparseMoE
from engine_svc.model.arch.rope import QKNorm, RotaryEmbedding, StepRope
from engine_svc.model.native import NativeKernels, PackedWeight

logger = logging.getLogger(__name__)


class NativeLinear(nn.Module):
    """``y = x @ W.T + b`` with W packed for the native GEMM; with ``silu_mul`` (a gate/up
    projection) ``y = silu(x @ Wg.T + bg) * (x @ Wu.T + bu)``."""

    def __init__(self, kernels: NativeKernels, packed: PackedWeight) -> None:
        super().__init__()
        self.kernels = kernels
        self.packed = packed  # not a Parameter: no state_dict entry

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.gemm(x, self.packed)

    def extra_repr(self) -> str:
        p = self.packed
        return f"in_features={p.in_features}, out_features={p.out_features}, silu_mul={p.silu_mul}"


class NativeRMSNorm(nn.Module):
    def __init__(self, kernels: NativeKernels, norm: RMSNorm) -> None:
        super().__init__()
        self.kernels = kernels
        self.eps = norm.eps
        self.weight = norm.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.eps), x
        # The stream is updated in place: it is this step's own tensor (the embedding
        # output, then sums), never a caller's.
        return self.kernels.rms_norm(x, self.weight, self.eps, residual=residual), residual


class NativeStepRope(StepRope):
    """Rotates q and k in place inside the fused qkv tensor and returns views of it."""

    def __init__(self, kernels: NativeKernels, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
        self.kernels = kernels
        self.positions = positions  # [num_tokens] int64
        self.cos_sin = cos_sin  # [max_position, head_dim] float32: cos | sin, rounded to the model dtype

    def split(
        self, qkv: torch.Tensor, nh: int, nkv: int, hd: int, qk_norm: QKNorm | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = qkv.shape[0]
        q, k, v = qkv.split((nh * hd, nkv * hd, nkv * hd), dim=-1)
        q, k, v = q.view(n, nh, hd), k.view(n, nkv, hd), v.view(n, nkv, hd)
        if qk_norm is not None:
            # Normed q and k go back into qkv, where the kernel rotates them in place.
            q_normed, k_normed = qk_norm(q, k)
            q.copy_(q_normed)
            k.copy_(k_normed)
        self.kernels.rope(qkv, self.positions, self.cos_sin, nh + nkv, hd)
        return q, k, v


class NativeRotary(nn.Module):
    def __init__(self, kernels: NativeKernels, rotary: RotaryEmbedding, max_position: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.kernels = kernels
        cos, sin = rotary.cos_sin(torch.arange(max_position), dtype)  # exactly the values the torch path uses
        self.cos_sin = torch.cat((cos, sin), dim=-1).float().contiguous()  # [max_position, head_dim]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> StepRope:
        return NativeStepRope(self.kernels, positions.contiguous(), self.cos_sin)


class NativeExperts:
    """``SparseMoE.run_expert`` on packed weights: gate/up with SiLU-and-multiply, then down."""

    def __init__(self, kernels: NativeKernels, moe: SparseMoE, dtype: torch.dtype) -> None:
        self.kernels = kernels
        self.packed = [
            (
                kernels.pack(moe.gate_up_experts[e], None, dtype, silu_mul=True),
                kernels.pack(moe.down_experts[e], None, dtype),
            )
            for e in range(moe.num_experts)
        ]

    def __call__(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.packed[expert]
        return self.kernels.gemm(self.kernels.gemm(x, gate_up), down)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


def install_native_layers(
    model: Transformer, kernels: NativeKernels, dtype: torch.dtype, rope_positions: int | None = None
) -> None:
    """Swap the model's norms and rotary embedding for native ones (see the module docstring).
    The rotary table holds ``rope_positions`` positions (the served context; default the
    model's max_position_embeddings): a model's context length alone must not size it."""
    for name, module in list(model.named_modules()):
        # The kernel norms the residual stream with a plain ``w`` gain; per-head q/k norms
        # and ``1 + w`` norms stay in PyTorch.
        if isinstance(module, RMSNorm) and not module.offset and not name.endswith(("q_norm", "k_norm")):
            _replace(model, name, NativeRMSNorm(kernels, module))
    assert isinstance(model.rotary, RotaryEmbedding), "native layers are installed once"
    if model.args.rotary_dim != model.args.head_dim:
        logger.info(
            "partial rotary embedding (%d of %d dims) runs in PyTorch", model.args.rotary_dim, model.args.head_dim
        )
        return
    positions = rope_positions or model.args.max_position_embeddings
    model.rotary = NativeRotary(kernels, model.rotary, positions, dtype)


def install_native_linears(model: Transformer, kernels: NativeKernels, dtype: torch.dtype) -> int:
    """Swap every ``nn.Linear`` for a ``NativeLinear``; returns how many were swapped."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in linears:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        fuse = isinstance(parent, MLP) and attr == "gate_up_proj" and parent.hidden_act == "silu"
        packed = kernels.pack(linear.weight, linear.bias, dtype, silu_mul=fuse)
        _replace(model, name, NativeLinear(kernels, packed))
        if fuse:
            assert isinstance(parent, MLP)
            parent.act_fused = True
    for module in model.modules():
        if isinstance(module, SparseMoE) and module.hidden_act == "silu":
            module.run_expert = NativeExperts(kernels, module, dtype)
    return len(linears)
