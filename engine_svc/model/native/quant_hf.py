"""Hugging Face quantized checkpoints' integer weights as the kernels' layout (quant.py), exactly.

    from_gptq(qweight, qzeros, scales, g_idx, bits, group, zero_plus_one) -> QuantizedWeight
    from_awq(qweight, qzeros, scales, group) -> QuantizedWeight
    from_compressed(weight, scale, bits, group, packed) -> QuantizedWeight

A linear layer's weight is W [N, K] as ``nn.Linear`` holds it (N outputs, K inputs), in
groups of G along K. The formats, as their tools write them:

    format                tensors                                             w[n, k] =
    GPTQ, 4 or 8 bits     qweight int32 [K*b/32, N]: along K, value i of     (q - z) * s
                          an int32 in bits b*i ..; qzeros int32
                          [K/G, N*b/32]: along N, the same; scales [K/G, N];
                          g_idx int32 [K] (the group of each k). The "gptq"
                          (v1) checkpoint format stores z - 1 (read as
                          (stored + 1) mod 2^b), "gptq_v2" z
    AWQ (GEMM), 4 bits    qweight int32 [K, N/8]: along N, value i of an     (q - z) * s
                          int32 is column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i];
                          qzeros int32 [K/G, N/8] the same; scales [K/G, N]
    compressed-tensors    pack-quantized: weight_packed int32 [N, K*b/32]:   q * s   (symmetric)
      W4A16 / W8A16       along K, value i in bits b*i .., stored as
                          q + 2^(b-1); naive / int-quantized: weight int8
                          [N, K]; weight_scale [N, K/G] (G = K: per channel)

Each maps onto ``w = q' * scale + min`` without rounding anything: 4-bit q' = q (0..15) with
min = -z * s; 8-bit q' = q - 128 (int8) with min = (128 - z) * s; a symmetric
compressed-tensors weight has q' = q + 8 (4-bit) or q (int8) and min = -8 s or none. A
float16 or bfloat16 scale times an integer below 2^9 is a float32 value, so min is exact,
and so is q' * s + min: every dequantized weight equals the format's own (q - z) * s.

Layouts the kernels cannot take (groups not a multiple of 16, a GPTQ g_idx that is not
k // G: act-order) raise ``UnsupportedQuantization`` naming what it is.
"""

from __future__ import annotations

import torch

from engine_svc.model.native.quant import QuantizedWeight, pack_nibbles

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column of each 4-bit value within an int32, AutoAWQ's


class UnsupportedQuantization(ValueError):
    pass


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32 / bits unsigned values each (value i in bits bits*i ..) ->
    int32 values, the words' values laid out in order along ``dim``."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    p = packed.to(torch.int32).movedim(dim, -1)
    values = (p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # arithmetic shift: the mask drops the sign
    return values.reshape(*p.shape[:-1], p.shape[-1] * per).movedim(-1, dim)


def _check_group(group: int, k: int, what: str) -> None:
    if group <= 0 or group % 16 or k % group or k % 32:
        raise UnsupportedQuantization(
            f"{what}: groups of {group} over {k} inputs; the quantized kernels take groups that are a "
            "multiple of 16 dividing the input width, itself a multiple of 32"
        )


def _layout(q: torch.Tensor, z: torch.Tensor | None, s: torch.Tensor, bits: int, group: int) -> QuantizedWeight:
    """q [N, K] int32 (0 .. 2^bits - 1), z [N, K/G] int32 or None (symmetric around 0 of the
    signed range: handled by the caller), s [N, K/G] float."""
    s = s.float().contiguous()
    if bits == 4:
        minimum = None if z is None else (-z.float() * s).contiguous()
        return QuantizedWeight(4, pack_nibbles(q.to(torch.uint8)), s, minimum, group)
    minimum = None if z is None else ((128 - z).float() * s).contiguous()
    return QuantizedWeight(8, (q - 128).to(torch.int8).contiguous(), s, minimum, group)


def from_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
    group: int,
    zero_plus_one: bool,
    what: str = "GPTQ weight",
) -> QuantizedWeight:
    q = unpack_int32(qweight, bits, 0).t()  # [N, K]
    n, k = q.shape
    group = k if group == -1 else group
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64), torch.arange(k) // group):
        raise UnsupportedQuantization(
            f"{what}: act-order (desc_act) with a permuted g_idx; the quantized kernels need groups of "
            "consecutive inputs (--quantization none serves it dequantized)"
        )
    _check_group(group, k, what)
    z = unpack_int32(qzeros, bits, 1)[:, :n].t()  # [N, K/G]
    if zero_plus_one:  # as AutoGPTQ's kernels read v1: the stored value plus one, in the value's bits
        z = (z + 1) & ((1 << bits) - 1)
    return _layout(q.contiguous(), z.contiguous(), scales.t(), bits, group)


def from_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int, what: str = "AWQ weight"
) -> QuantizedWeight:
    reorder = torch.tensor([AWQ_ORDER.index(c) for c in range(8)])  # position of column c in a word

    def columns(packed: torch.Tensor) -> torch.Tensor:
        values = unpack_int32(packed, 4, 1)
        words = values.view(values.shape[0], -1, 8)
        return words[:, :, reorder].reshape(values.shape[0], -1)

    q = columns(qweight).t()  # [N, K]
    n, k = q.shape
    _check_group(group, k, what)
    return _layout(q.contiguous(), columns(qzeros).t().contiguous(), scales.t(), 4, group)


def from_compressed(
    weight: torch.Tensor, scale: torch.Tensor, bits: int, group: int, packed: bool, what: str = "weight"
) -> QuantizedWeight:
    """A symmetric compressed-tensors weight: packed int32 [N, K*b/32] (values + 2^(b-1)) or
    int8 [N, K]; ``scale`` [N, K/G] (G = -1 or K: one per row; a single scale: one per tensor)."""
    q = unpack_int32(weight, bits, 1) if packed else weight.to(torch.int32) + 128
    n, k = q.shape
    group = k if group == -1 else group
    s = scale.float().reshape(-1, 1).expand(n, 1) if scale.numel() == 1 else scale.float().reshape(n, -1)
    if s.shape[1] != k // group:
        raise UnsupportedQuantization(f"{what}: {s.shape[1]} scales a row do not fit groups of {group} over {k}")
    _check_group(group, k, what)
    if bits == 4:
        return QuantizedWeight(4, pack_nibbles(q.to(torch.uint8)), s.contiguous(), (-8.0 * s).contiguous(), group)
    return QuantizedWeight(8, (q - 128).to(torch.int8).contiguous(), s.contiguous(), None, group)
