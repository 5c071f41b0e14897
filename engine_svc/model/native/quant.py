"""Quantized linear weights as every source maps them (GGUF blocks, Hugging Face GPTQ / AWQ /
compressed-tensors checkpoints, quantization at load), and the reference arithmetic the
kernels are tested against. The kernel's own panel order is ``quant_pack.py``'s.

    QuantizedWeight(bits, qs, scale, min, group)      w[n, k] = q[n, k] * scale[n, g] + min[n, g]
                                                      g = k // group
    bits 8: qs int8 [N, K]
    bits 4: qs uint8 [N, K/2]; in each block of 32 along K, byte j holds q[32b + j] (low
            nibble) and q[32b + 16 + j] (high nibble), GGUF's order, so its Q4 blocks copy as
            they are
    group: any multiple of 16 that divides K (K a multiple of 32); min optional

Every GGUF type the engine keeps quantized maps onto one of these exactly (the scales are
float32 here, so a K-quant's d * sub-scale is kept without rounding); quantizing a float
checkpoint at load uses the same layouts: ``quantize_int8`` (symmetric, per group of 32,
like Q8_0) and ``quantize_int4`` (scale and min per group of 32, like Q4_1), both with
scales rounded to float16 as GGUF stores them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantizedWeight:
    bits: int
    qs: torch.Tensor
    scale: torch.Tensor  # float32 [N, K / group]
    min: torch.Tensor | None  # float32 [N, K / group], or None for symmetric groups
    group: int

    def __post_init__(self) -> None:
        n, cols = self.qs.shape
        k = cols * (2 if self.bits == 4 else 1)
        if self.bits not in (4, 8) or self.group <= 0 or self.group % 16:
            raise ValueError(f"unsupported quantized layout: {self.bits} bits in groups of {self.group}")
        if k % 32 or k % self.group or tuple(self.scale.shape) != (n, k // self.group):
            raise ValueError(f"scales of shape {tuple(self.scale.shape)} do not fit weights of shape [{n}, {k}]")
        if self.min is not None and self.min.shape != self.scale.shape:
            raise ValueError("mins and scales differ in shape")
        want = torch.int8 if self.bits == 8 else torch.uint8
        if self.qs.dtype != want or self.scale.dtype != torch.float32 or not self.qs.is_contiguous():
            raise ValueError(f"a {self.bits}-bit weight is contiguous {want} with float32 scales")

    @property
    def out_features(self) -> int:
        return self.qs.shape[0]

    @property
    def in_features(self) -> int:
        return self.qs.shape[1] * (2 if self.bits == 4 else 1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scale, self.min) if t is not None)

    def nibbles(self) -> torch.Tensor:
        """A 4-bit weight's q as uint8 [N, K]."""
        n = self.qs.shape[0]
        blocks = self.qs.view(n, -1, 16)
        return torch.cat([blocks & 15, blocks >> 4], dim=2).reshape(n, -1)

    def values(self) -> torch.Tensor:
        """q as float32 [N, K] (the nibbles unpacked)."""
        return self.qs.float() if self.bits == 8 else self.nibbles().float()

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] the kernels compute with."""
        n, k = self.out_features, self.in_features
        q = self.values().view(n, k // self.group, self.group)
        w = q * self.scale.unsqueeze(2)
        if self.min is not None:
            w = w + self.min.unsqueeze(2)
        return w.reshape(n, k)

    def dequantize_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` of ``dequantize()``, the others left alone (an embedding lookup)."""
        return take_rows(self, index).dequantize()


def quantize_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., K] float32 as the int8-activation GEMM computes with it, dequantized: per row and
    group of ``group`` along K, q = round(x * (127 / a)) to nearest even with a = max |x| over
    the group, times the scale a / 127 (zero where a is 0). The product is then
    F.linear(quantize_activations(x, w.group), w.dequantize()), up to the order of additions."""
    k = x.shape[-1]
    g = x.float().reshape(-1, k // group, group)
    a = g.abs().amax(dim=2, keepdim=True)
    # a true division (``127.0 / a`` would be torch's reciprocal-then-multiply, an ulp away)
    inv = torch.where(a > 0, torch.full_like(a, 127.0).div(a), torch.zeros_like(a))
    return ((g * inv).round() * (a / 127.0)).reshape(x.shape)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] -> [N, K/2] in GGUF's order within each group of 32."""
    n, k = q.shape
    blocks = q.to(torch.uint8).view(n, k // 32, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def _as_float16(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to float16 values (kept float32), as GGUF stores scales, where every
    value is zero or a normal float16 number; else unchanged (no scale loses precision)."""
    a = t.abs()
    if bool(((a == 0) | ((a >= 2.0**-14) & (a <= 65504.0))).all()):
        return t.to(torch.float16).float()
    return t


def quantize_int8(weight: torch.Tensor, group: int = 32) -> QuantizedWeight:
    """Symmetric int8 per group along K: scale = max|w| / 127 (Q8_0's rule), rounded to float16."""
    w = weight.detach().float()
    n, k = w.shape
    g = w.view(n, k // group, group)
    scale = _as_float16(g.abs().amax(dim=2) / 127.0)
    q = torch.where(scale.unsqueeze(2) > 0, g / scale.clamp_min(1e-30).unsqueeze(2), 0.0).round().clamp(-127, 127)
    return QuantizedWeight(8, q.to(torch.int8).reshape(n, k).contiguous(), scale.contiguous(), None, group)


def quantize_int4(weight: torch.Tensor) -> QuantizedWeight:
    """Asymmetric 4-bit per group of 32: min = the group's minimum, scale = range / 15 (Q4_1's
    rule), both rounded to float16."""
    w = weight.detach().float()
    n, k = w.shape
    g = w.view(n, k // 32, 32)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    both = _as_float16(torch.stack([lo, (hi - lo) / 15.0]))
    lo, scale = both[0], both[1]
    q = torch.where(scale.unsqueeze(2) > 0, (g - lo.unsqueeze(2)) / scale.clamp_min(1e-30).unsqueeze(2), 0.0)
    q = q.round().clamp(0, 15).reshape(n, k)
    return QuantizedWeight(4, pack_nibbles(q), scale.contiguous(), lo.contiguous(), 32)


def take_rows(w: QuantizedWeight, index: torch.Tensor) -> QuantizedWeight:
    """The weight's output rows in the order of ``index`` (rows are independent groups)."""
    return QuantizedWeight(
        w.bits,
        w.qs[index].contiguous(),
        w.scale[index].contiguous(),
        None if w.min is None else w.min[index].contiguous(),
        w.group,
    )


def relayout(w: QuantizedWeight, bits: int, group: int, with_min: bool) -> QuantizedWeight:
    """The same weight with ``bits`` (no fewer than its own), groups of ``group`` (dividing its
    own) and a min if ``with_min``, without changing a value: 4-bit values fit int8, a
    group's scale and min repeat, a missing min is 0."""
    if bits < w.bits or w.group % group:
        raise ValueError(f"{w.bits}-bit groups of {w.group} cannot become {bits}-bit groups of {group}")
    repeat = w.group // group
    qs = w.values().to(torch.int8).contiguous() if bits == 8 and w.bits == 4 else w.qs
    minimum = w.min if w.min is not None or not with_min else torch.zeros_like(w.scale)
    return QuantizedWeight(
        bits,
        qs,
        w.scale.repeat_interleave(repeat, dim=1).contiguous(),
        None if minimum is None else minimum.repeat_interleave(repeat, dim=1).contiguous(),
        group,
    )


def with_groups_of_at_most(w: QuantizedWeight, most: int) -> QuantizedWeight:
    """The same weight with groups of 32 (16 where 32 does not divide them) if its own are
    wider than ``most``: every scale and min repeated, no value changed."""
    if w.group <= most:
        return w
    return relayout(w, w.bits, 32 if w.group % 32 == 0 else 16, w.min is not None)


def as_int8(w: QuantizedWeight, group: int) -> QuantizedWeight:
    """The same weight in the int8 layout with groups of ``group``."""
    return w if w.bits == 8 and w.group == group else relayout(w, 8, group, w.min is not None)


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Weights stacked along N (a fused q/k/v or gate/up projection). Parts of different
    layouts meet in the widest one (int8 if any part is, groups dividing every part's, a min if any
    part has one), which changes no value."""
    bits, group = max(p.bits for p in parts), math.gcd(*(p.group for p in parts))
    with_min = any(p.min is not None for p in parts)
    parts = [relayout(p, bits, group, with_min) for p in parts]
    first = parts[0]
    return QuantizedWeight(
        first.bits,
        torch.cat([p.qs for p in parts]).contiguous(),
        torch.cat([p.scale for p in parts]).contiguous(),
        None if first.min is None else torch.cat([p.min for p in parts if p.min is not None]).contiguous(),
        first.group,
    )
