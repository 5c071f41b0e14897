"""Linear layers with their weights kept quantized, on the native quantized GEMM (quant.c).

    install_quantized_linears(model, kernels, method)   every nn.Linear but the LM head ->
                                                         QuantizedLinear, quantized at load

``method`` is ``--quantization``: ``int8`` (symmetric, groups of 32, Q8_0's rule) or ``int4``
(scale and min per group of 32, Q4_1's rule). The LM head and the embeddings keep the
serving dtype: the head is where quantization error turns straight into wrong tokens, and
the embedding is read one row per token, so its bytes do not set a step's pace.

A decode step at small batch reads every weight once, so its time follows the weights'
bytes: 1.0625 bytes a weight for int8 (with its float16 scales), 0.625 for int4, against 4
for float32 and 2 for bfloat16.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn import functional as F

from engine_svc.model.arch.layers import MLP
from engine_svc.model.arch.llama import Transformer
from engine_svc.model.native import NativeKernels
from engine_svc.model.native.kernels import INT8_ACTIVATION_MAX_GROUP, supports_int8_activations
from engine_svc.model.native.quant import QuantizedWeight, quantize_int4, quantize_int8

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "int4")


class QuantizedLinear(nn.Module):
    """``y = x @ dequantized(W).T + b``; a fused gate/up weight applies SiLU-and-multiply.
    The weight is held only in the kernel's panels (``native/quant_pack.py``)."""

    def __init__(self, kernels: NativeKernels, weight: QuantizedWeight, bias: torch.Tensor | None, silu_mul: bool):
        super().__init__()
        self.kernels = kernels
        self.weight_p = kernels.qpack(weight, bias, silu_mul)  # not a Parameter: no state_dict entry
        self.silu_mul = silu_mul
        self.int8_activations = False  # quantize_activations sets it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.qgemm(_rows(x), self.weight_p, int8_activations=self.int8_activations)

    def pre_activation(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T + b: for a gate/up weight both halves, [gate | up], before SiLU-and-multiply
        (a LoRA adapter adds its term there: model/lora/slots.py)."""
        return self.kernels.qgemm(_rows(x), self.weight_p, pre_activation=True, int8_activations=self.int8_activations)

    def activate(self, y: torch.Tensor) -> torch.Tensor:
        if not self.silu_mul:
            return y
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up

    def extra_repr(self) -> str:
        w = self.weight_p
        return (
            f"in_features={w.in_features}, out_features={w.out_features}, bits={w.bits}, silu_mul={self.silu_mul}, "
            f"int8_activations={self.int8_activations}"
        )


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous() if x.stride(-1) != 1 else x


def quantize(weight: torch.Tensor, method: str) -> QuantizedWeight:
    if method == "int8":
        return quantize_int8(weight)
    if method == "int4":
        return quantize_int4(weight)
    raise ValueError(f"unknown quantization {method!r}; known: {', '.join(QUANTIZATIONS)}")


def install_prequantized_linears(
    model: Transformer, kernels: NativeKernels, weights: dict[str, QuantizedWeight]
) -> int:
    """Swap the linear layers named in ``weights`` (a GGUF's blocks, ``load/gguf_quantized.py``)
    for QuantizedLinear layers over them; returns how many."""
    for name, qw in weights.items():
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear) and tuple(linear.weight.shape) == (qw.out_features, qw.in_features), name
        _swap(model, name, QuantizedLinear(kernels, qw, linear.bias, silu_mul=_is_gate_up(model, name)))
    return len(weights)


def _is_gate_up(model: Transformer, name: str) -> bool:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    return isinstance(parent, MLP) and attr == "gate_up_proj" and parent.hidden_act == "silu"


def _swap(model: Transformer, name: str, layer: QuantizedLinear) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    setattr(parent, attr, layer)
    if layer.silu_mul:
        assert isinstance(parent, MLP)
        parent.act_fused = True


def install_quantized_linears(model: Transformer, kernels: NativeKernels, method: str) -> int:
    """Quantize every linear layer but the LM head, in place; returns how many. A layer
    whose input width is not a whole number of groups of 32 keeps its dtype."""
    count, weight_bytes, quantized_bytes = 0, 0, 0
    for name, linear in [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
        if name == "lm_head" or linear.in_features % 32:
            continue
        layer = QuantizedLinear(kernels, quantize(linear.weight, method), linear.bias, _is_gate_up(model, name))
        _swap(model, name, layer)
        count += 1
        weight_bytes += linear.weight.numel() * linear.weight.element_size()
        quantized_bytes += layer.weight_p.nbytes
    logger.info(
        "quantization %s: %d linear layers, %.1f MiB of weights kept as %.1f MiB",
        method,
        count,
        weight_bytes / 2**20,
        quantized_bytes / 2**20,
    )
    return count


def quantize_activations(model: nn.Module, kernels: NativeKernels | None) -> int:
    """``--activation-quantization int8``: every QuantizedLinear of ``model`` quantizes its
    input to int8 per row and group of its weight and sums by integer dot products
    (``NativeKernels.qgemm``); returns how many. (A GGUF file's quantized LM head takes them
    too: ``install_quantized_embeddings``; a float head does not.) Raises ValueError where
    the CPU has no int8 dot products or the model has no quantized layer to apply it to."""
    if kernels is None or not kernels.int8_dot_products:
        raise ValueError(
            "--activation-quantization int8 needs the native kernels on a CPU with AVX512-VNNI or AVX-VNNI "
            f"(this one: {kernels.isa if kernels else 'no native kernels'}); drop it"
        )
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    if not layers:
        raise ValueError(
            "--activation-quantization int8 applies to quantized linear layers, and this model has none: "
            "serve a quantized checkpoint or add --quantization int8 / int4"
        )
    taken = [m for m in layers if supports_int8_activations(kernels, m.weight_p)]
    for m in taken:
        m.int8_activations = True
    skipped = (
        f" (the other {len(layers) - len(taken)}: groups over {INT8_ACTIVATION_MAX_GROUP})"
        if len(taken) < len(layers)
        else ""
    )
    logger.info("activation quantization int8: %d of %d quantized linear layers%s", len(taken), len(layers), skipped)
    return len(taken)
