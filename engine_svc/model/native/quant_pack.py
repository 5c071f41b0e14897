"""Quantized weights in the quantized GEMM's panels (quant.c), packed once at load.

    pack_panels(w, panel_width, bias=None, silu_mul=False) -> PackedQuantWeight
    packed.dequantize() -> float32 [rows, K] in the weight's own row order
    packed.dequantize_rows(index) -> float32 [len(index), K]: those rows alone (an
                                     embedding lookup on a tied LM head's panels)

The kernel reads a weight the way the packed float GEMM reads its panels (gemm.c): panel p
holds output columns p*NR .. p*NR+NR-1 (NR = ``panel_width``, two vector registers; zeros
past the last row), K down the rows, so one k's NR weights dequantize into one pair of
vectors with no transpose, on the register path and into the wide path's buffer alike:

    bits 8: qs int8  [P, K, NR]
    bits 4: qs uint8 [P, K/2, NR]    byte (k/2, j): weight k (even) low nibble, k + 1 high
    scale, min       [P, K/G, NR]    float16 where every value is exactly a float16, else float32
    bias             [P * NR]        float32, panel order

With ``silu_mul`` the first half of the rows (gate) and the second (up) are packed as
alternating panels, as ``tk_gemm_pack`` packs pairs, for the kernel's SiLU-and-multiply.

Scales and mins are held as float16 where that changes none of them (GGUF's Q4_0, Q4_1,
Q8_0, Q5_x blocks, whose scales are float16 in the file, and quantization at load, which
rounds its scales to float16 first): 0.625 bytes a weight at 4 bits with groups of 32, the
bytes of GGUF's Q4_1. A K-quant's products of two scales are not float16 values and stay
float32.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from engine_svc.model.native.api import EPILOGUE_NONE, EPILOGUE_SILU_MUL, SCALE_CODES, Linear
from engine_svc.model.native.quant import QuantizedWeight


@dataclass(frozen=True)
class PackedQuantWeight:
    bits: int
    qs: torch.Tensor
    scale: torch.Tensor  # float16 or float32 [P, K / group, NR]
    min: torch.Tensor | None  # the scale's dtype and shape, or None
    group: int
    in_features: int
    out_features: int  # columns of the result: half the rows with silu_mul
    silu_mul: bool
    bias: torch.Tensor | None  # float32 [P * NR], panel order
    # qs, scale, min, bias as the kernel's pointer arguments (None: NULL), made once: the
    # tensors never move
    pointers: tuple = field(init=False, repr=False, compare=False)
    _linears: dict[tuple[bool, bool], Linear] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tensors = (self.qs, self.scale, self.min, self.bias)
        object.__setattr__(
            self, "pointers", tuple(None if t is None else ctypes.c_void_p(t.data_ptr()) for t in tensors)
        )

    def linear(self, raw: bool = False, int8_activations: bool = False) -> Linear:
        """The weight as ``tk_qgemm`` takes it (made once per kind of call): ``raw``, every panel
        as it is (a gate/up weight's gate and up panels alternating, no SiLU-and-multiply)."""
        key = (raw, int8_activations)
        if key not in self._linears:
            qs, scale, minimum, bias = self.pointers
            self._linears[key] = Linear(
                1, self.bits, qs, scale, minimum, SCALE_CODES[self.scale.dtype], self.group, bias,
                self.qs.shape[0] * self.panel_width if raw else self.out_features, self.in_features,
                EPILOGUE_SILU_MUL if self.silu_mul and not raw else EPILOGUE_NONE, int(int8_activations),
            )  # fmt: skip
        return self._linears[key]

    @property
    def panel_width(self) -> int:
        return self.scale.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scale, self.min) if t is not None)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [rows, K] the kernel computes with, rows in the order packed."""
        p, nr, k = self.qs.shape[0], self.panel_width, self.in_features
        if self.bits == 4:
            b = self.qs.permute(0, 2, 1)  # [P, NR, K/2]
            q = torch.stack([b & 15, b >> 4], dim=3).reshape(p, nr, k).float()
        else:
            q = self.qs.permute(0, 2, 1).float()
        s = self.scale.float().permute(0, 2, 1).unsqueeze(3)  # [P, NR, K/G, 1]
        w = q.view(p, nr, k // self.group, self.group) * s
        if self.min is not None:
            w = w + self.min.float().permute(0, 2, 1).unsqueeze(3)
        slots = _slots(self.rows, nr, self.silu_mul)
        return w.reshape(p * nr, k)[slots >= 0][torch.argsort(slots[slots >= 0])]

    def dequantize_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` of ``dequantize()``, read from their panels alone: the same values,
        computed by the same operations, so an embedding looked up here equals one looked up
        in the weight's blocks bit for bit."""
        if self.silu_mul:
            raise ValueError("rows are read from a weight packed without silu_mul")
        nr, k = self.panel_width, self.in_features
        panel, col = index // nr, index % nr
        if self.bits == 4:
            b = self.qs[panel, :, col]  # [n, K/2]
            q = torch.stack([b & 15, b >> 4], dim=2).reshape(-1, k).float()
        else:
            q = self.qs[panel, :, col].float()
        w = q.view(-1, k // self.group, self.group) * self.scale[panel, :, col].float().unsqueeze(2)
        if self.min is not None:
            w = w + self.min[panel, :, col].float().unsqueeze(2)
        return w.reshape(-1, k)

    @property
    def rows(self) -> int:
        return self.out_features * (2 if self.silu_mul else 1)


def _slots(rows: int, nr: int, silu_mul: bool) -> torch.Tensor:
    """For each panel column, the weight row it holds, or -1 (padding)."""
    half = rows // 2 if silu_mul else rows
    tiles = -(-half // nr)
    col = torch.arange(tiles * nr)
    own = torch.where(col < half, col, -1).view(tiles, 1, nr)
    if not silu_mul:
        return own.reshape(-1)
    up = torch.where(own >= 0, own + half, -1)
    return torch.cat([own, up], dim=1).reshape(-1)  # panels gate 0, up 0, gate 1, up 1, ...


def _gather(t: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows of ``t`` by slot, zeros where the slot is -1."""
    padded = torch.cat([t, torch.zeros(1, *t.shape[1:], dtype=t.dtype)])
    return padded[torch.where(slots >= 0, slots, t.shape[0])]


def compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` as float16 where every value survives the round trip, else as it is."""
    half = t.to(torch.float16)
    return half if torch.equal(half.float(), t.float()) else t


def pack_panels(
    w: QuantizedWeight, panel_width: int, bias: torch.Tensor | None = None, silu_mul: bool = False
) -> PackedQuantWeight:
    n, k, nr = w.out_features, w.in_features, panel_width
    if silu_mul and n % 2:
        raise ValueError("a gate/up weight has an even number of rows")
    slots = _slots(n, nr, silu_mul)
    num_panels = slots.numel() // nr
    if w.bits == 4:
        q = _gather(w.nibbles(), slots).view(num_panels, nr, k // 2, 2)
        qs = (q[..., 0] | (q[..., 1] << 4)).permute(0, 2, 1).contiguous()
    else:
        qs = _gather(w.qs, slots).view(num_panels, nr, k).permute(0, 2, 1).contiguous()

    def panels(t: torch.Tensor) -> torch.Tensor:
        return _gather(t, slots).view(num_panels, nr, -1).permute(0, 2, 1).contiguous()

    scale, minimum = panels(w.scale.float()), None if w.min is None else panels(w.min.float())
    small = compact(scale if minimum is None else torch.stack([scale, minimum]))
    if small.dtype == torch.float16:
        scale, minimum = (small, None) if minimum is None else (small[0].contiguous(), small[1].contiguous())
    packed_bias = None if bias is None else _gather(bias.detach().float(), slots).contiguous()
    return PackedQuantWeight(w.bits, qs, scale, minimum, w.group, k, n // 2 if silu_mul else n, silu_mul, packed_bias)
