"""GGUF's quantized blocks as the native kernels' layouts (quant.py), bit for bit.

    from_gguf_blocks(type_name, raw, (N, K)) -> QuantizedWeight

``raw`` is a tensor's bytes as the file holds them, ``uint8 [N, K / block * block_bytes]``.
Each type maps onto one layout without rounding anything but what GGUF itself rounds
(its float16 scales, widened; a K-quant's super-block scale times its 6-bit sub-scale,
one float32 product, as llama.cpp's own dequantization computes it):

    type   block            layout                 w =
    Q8_0   32: d, q8        int8, groups of 32     q * d
    Q4_0   32: d, q4        4-bit, groups of 32    q * d + (-8 d)
    Q4_1   32: d, m, q4     4-bit, groups of 32    q * d + m
    Q5_0   32: d, qh, q4    int8, groups of 32     q * d + (-16 d)       (q: 5 bits)
    Q5_1   32: d, m, qh, q4 int8, groups of 32     q * d + m
    Q4_K   256: d, dmin, 8 x (6-bit sc, m), q4     4-bit, groups of 32    q * (d sc) + (-(dmin m))
    Q5_K   256: as Q4_K, plus a fifth bit           int8, groups of 32    q * (d sc) + (-(dmin m))
    Q6_K   256: 16 x int8 sc, d, 6-bit q            int8, groups of 16    (q - 32) * (d sc)

Other types (Q2_K, Q3_K, the IQ family, ...) are refused by name.
"""

from __future__ import annotations

import numpy as np
import torch

from engine_svc.model.native.quant import QuantizedWeight, pack_nibbles

BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BLOCK_SIZE = {name: 256 if name.endswith("_K") else 32 for name in BLOCK_BYTES}
SUPPORTED_TYPES = tuple(BLOCK_BYTES)


def from_gguf_blocks(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    if type_name not in BLOCK_BYTES:
        raise ValueError(
            f"GGUF tensor type {type_name} cannot be kept quantized; supported: {', '.join(SUPPORTED_TYPES)}"
        )
    n, k = shape
    qk = BLOCK_SIZE[type_name]
    if k % qk:
        raise ValueError(f"a {type_name} tensor's rows hold whole blocks of {qk}; got {k} columns")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n * (k // qk), BLOCK_BYTES[type_name])
    return _CONVERTERS[type_name](blocks, n, k)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of every block, as float32 [num_blocks]."""
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)[:, 0]


def _low_high(qs: np.ndarray) -> np.ndarray:
    """16 bytes of a 32-weight block -> the 32 values 0..15 (low nibbles, then high)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _weight(bits: int, q: np.ndarray, scale: np.ndarray, minimum: np.ndarray | None, group: int, n: int, k: int):
    if bits == 4:
        qs = pack_nibbles(torch.from_numpy(q.reshape(n, k).astype(np.uint8)))
    else:
        qs = torch.from_numpy(q.reshape(n, k).astype(np.int8))
    return QuantizedWeight(
        bits,
        qs.contiguous(),
        torch.from_numpy(scale.reshape(n, k // group).astype(np.float32)),
        None if minimum is None else torch.from_numpy(minimum.reshape(n, k // group).astype(np.float32)),
        group,
    )


def _q8_0(b: np.ndarray, n: int, k: int) -> QuantizedWeight:
    return _weight(8, b[:, 2:].view(np.int8), _f16(b, 0), None, 32, n, k)


def _q4_0(b: np.ndarray, n: int, k: int) -> QuantizedWeight:
    d = _f16(b, 0)
    return _weight(4, _low_high(b[:, 2:]), d, -8.0 * d, 32, n, k)


def _q4_1(b: np.ndarray, n: int, k: int) -> QuantizedWeight:
    return _weight(4, _low_high(b[:, 4:]), _f16(b, 0), _f16(b, 2), 32, n, k)


def _fifth_bit(qh: np.ndarray) -> np.ndarray:
    """4 bytes of high bits -> 32 values of 0 or 16 (bit j is weight j's fifth bit)."""
    bits = qh.copy().view(np.uint32)[:, 0:1] >> np.arange(32, dtype=np.uint32)
    return ((bits & 1) << 4).astype(np.uint8)


def _q5_0(b: np.ndarray, n: int, k: int) -> QuantizedWeight:
    d = _f16(b, 0)
    return _weight(8, _low_high(b[:, 6:]) | _fifth_bit(b[:, 2:6]), d, -16.0 * d, 32, n, k)


def _q5_1(b: np.ndarray, n: int, k: int) -> QuantizedWeight:
    return _weight(8, _low_high(b[:, 8:]) | _fifth_bit(b[:, 4:8]), _f16(b, 0), _f16(b, 2), 32, n, k)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes of a Q4_K / Q5_K super-block -> 8 six-bit scales and 8 six-bit mins."""
    s = s.astype(np.uint8)
    sc = np.empty((s.shape[0], 8), np.uint8)
    m = np.empty((s.shape[0], 8), np.uint8)
    sc[:, :4], m[:, :4] = s[:, 0:4] & 63, s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)
    m[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc.astype(np.float32), m.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 256 values: each 32 bytes give one 64-weight chunk, low nibbles first."""
    chunks = qs.reshape(-1, 4, 32)
    return np.concatenate([chunks & 15, chunks >> 4], axis=2).reshape(-1, 256)


def _q4_k(b: np.ndarray, n: int, k: int) -> QuantizedWeight:
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, m = _k_scales(b[:, 4:16])
    return _weight(4, _k_nibbles(b[:, 16:]), d[:, None] * sc, -(dmin[:, None] * m), 32, n, k)


def _q5_k(b: np.ndarray, n: int, k: int) -> QuantizedWeight:
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, m = _k_scales(b[:, 4:16])
    qh = b[:, 16:48]  # bit 2j (low) and 2j+1 (high) of byte l: the fifth bits of chunk j's weight l and 32 + l
    high = np.stack([np.concatenate([(qh >> (2 * j)) & 1, (qh >> (2 * j + 1)) & 1], axis=1) for j in range(4)], axis=1)
    q = _k_nibbles(b[:, 48:]) | (high.reshape(-1, 256) << 4)
    return _weight(8, q, d[:, None] * sc, -(dmin[:, None] * m), 32, n, k)


def _q6_k(b: np.ndarray, n: int, k: int) -> QuantizedWeight:
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8).astype(np.float32), _f16(b, 208)
    out = np.empty((b.shape[0], 256), np.int16)
    for half in range(2):
        l4, h = ql[:, half * 64 : half * 64 + 64], qh[:, half * 32 : half * 32 + 32]
        base = half * 128
        out[:, base : base + 32] = (l4[:, :32] & 15) | (((h >> 0) & 3) << 4)
        out[:, base + 32 : base + 64] = (l4[:, 32:] & 15) | (((h >> 2) & 3) << 4)
        out[:, base + 64 : base + 96] = (l4[:, :32] >> 4) | (((h >> 4) & 3) << 4)
        out[:, base + 96 : base + 128] = (l4[:, 32:] >> 4) | (((h >> 6) & 3) << 4)
    return _weight(8, out - 32, d[:, None] * sc, None, 16, n, k)


_CONVERTERS = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}  # fmt: skip
