"""Linear layers with weights pre-packed for oneDNN, for CPU inference.

``F.linear`` on CPU re-reads a row-major weight for every call and, for the few-row
matrices of a decode step, runs far below the machine's speed (measured on a 2-core AVX2
CPU with the 135M benchmark model: 4 rows x all 30 layers 90 ms with ``F.linear``,
~45 ms packed; 64 rows 190 ms vs ~150 ms). oneDNN reorders each weight once into its
blocked layout at load time; every step then calls the packed matmul. These are the ops
that torch's own CPU compiler emits for frozen linear layers
(``mkldnn::_reorder_linear_weight`` / ``mkldnn::_linear_pointwise``); they are private
to torch, so ``pack_linears`` checks each packed layer against ``F.linear`` once and
keeps the plain layer wherever the op is missing or disagrees.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

# Relative tolerance of the one-off check: different blocking changes fp32 rounding only.
_CHECK_RTOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` in oneDNN's packed layout. x: [num_tokens, in_features]."""

    def __init__(self, packed_weight: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int):
        super().__init__()
        self.packed_weight = packed_weight  # opaque mkldnn tensor; not a Parameter (no state_dict entry)
        self.bias = bias
        self.in_features = in_features
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in _CHECK_RTOL
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_linear(linear: nn.Linear, batch_size_hint: int) -> PackedLinear | None:
    """A packed copy of ``linear``, or None if this torch build cannot pack it correctly."""
    weight = linear.weight.detach()
    bias = None if linear.bias is None else linear.bias.detach()
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size_hint)
        layer = PackedLinear(packed, bias, linear.in_features, linear.out_features)
        x = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        got, want = layer(x).float(), F.linear(x, weight, bias).float()
    except (RuntimeError, NotImplementedError) as e:
        logger.warning("oneDNN weight packing unavailable (%s); using plain linear layers", e)
        return None
    err = (got - want).abs().max().item()
    if not err <= _CHECK_RTOL[weight.dtype] * max(1.0, want.abs().max().item()):
        logger.warning("oneDNN packed linear differs from F.linear by %.3g; using plain linear layers", err)
        return None
    return layer


def pack_linears(model: nn.Module, batch_size_hint: int) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``PackedLinear`` in place; returns how
    many were packed. Stops at the first layer that cannot be packed (all or nothing, so
    one run never mixes two matmul implementations)."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    packed: list[tuple[str, PackedLinear]] = []
    for name, linear in targets:
        layer = pack_linear(linear, batch_size_hint)
        if layer is None:
            return 0
        packed.append((name, layer))
    for name, layer in packed:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, layer)
    return len(packed)
