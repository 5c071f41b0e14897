"""LoRA adapters in numbered slots, and the layers that add their terms per row.

    LoraSlots(model, kernels, num_slots=S, max_rank=r)   wraps every q/k/v/o/gate/up/down
                                                         projection in a LoraLinear
    slots.write(slot, adapter) / slots.clear(slot)       between steps
    slots.begin_step(row_slots) ... model(...) ... slots.end_step()

Each wrapped module keeps one stack per kind, shared by all slots::

    la     [S, R, K]     float32   lora_A of each part, stacked along R (q, k, v: R = 3r)
    lb     [S, R, cols]  float32   lora_B^T x scale, the parts' columns where the module's
                                   output has them (in the native GEMM's panel order there)
    ranks  [S]           int32     rows of la / lb a slot uses (its parts' ranks, summed)

A step whose rows use no adapter runs the base layers alone (``begin_step(None)``): the
wrappers cost one attribute read. Otherwise every row has a slot (-1: the base model) and:

* on the native GEMM the term is added inside the GEMM call (gemm_lora.h): one pass over
  the base weights for every row, each row's rank-R term added to its output tile, before
  the fused SiLU-and-multiply where there is one. Base rows get the same bits as without
  adapters.
* elsewhere (PyTorch, oneDNN, quantized weights) the base layer runs on every row and each
  slot's rows get ``(x @ A^T) @ B^T`` added with ``index_add_`` before the activation.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from engine_svc.model.llama import Transformer
from engine_svc.model.lora.adapter import NUM_PARTS, LoraAdapter, module_shapes
from engine_svc.model.native import NativeKernels
from engine_svc.model.native_layers import NativeLinear
from engine_svc.model.quantized_layers import QuantizedLinear

logger = logging.getLogger(__name__)


@dataclass
class LoraBatch:
    """One step's rows: which slot each row adds (-1: none)."""

    row_slots: list[int]
    max_rank: int  # the widest R of any module: the workspace holds rows x this
    row_slot: torch.Tensor = field(init=False)  # int32 [rows]
    xa: torch.Tensor = field(init=False)  # float32 [rows * max_rank]: the native GEMM's workspace
    _groups: list[tuple[int, torch.Tensor]] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.row_slot = torch.tensor(self.row_slots, dtype=torch.int32)
        self.xa = torch.empty(len(self.row_slots) * self.max_rank, dtype=torch.float32)

    @property
    def groups(self) -> list[tuple[int, torch.Tensor]]:
        """(slot, the rows that add it) per slot in use, for the PyTorch path."""
        if self._groups is None:
            rows: dict[int, list[int]] = {}
            for row, slot in enumerate(self.row_slots):
                if slot >= 0:
                    rows.setdefault(slot, []).append(row)
            self._groups = [(slot, torch.tensor(r, dtype=torch.long)) for slot, r in rows.items()]
        return self._groups


class LoraStep:
    """What every wrapped layer reads during a forward pass: the step's ``LoraBatch``, or
    None when no row uses an adapter. Set by ``LoraSlots.begin_step`` only."""

    def __init__(self) -> None:
        self.batch: LoraBatch | None = None


class LoraLinear(nn.Module):
    """A projection plus the LoRA term of each row's adapter (module docstring)."""

    def __init__(
        self,
        base: nn.Module,
        step: LoraStep,
        *,
        num_slots: int,
        in_features: int,
        part_widths: Sequence[int],
        max_rank: int,
        kernels: NativeKernels | None,
    ) -> None:
        super().__init__()
        self.base = base
        self.step = step
        self.native = kernels if isinstance(base, NativeLinear) else None
        self.packed = base.packed if isinstance(base, NativeLinear) else None
        self.part_widths = tuple(part_widths)
        self.max_rank = max_rank * len(part_widths)  # R: every part at the largest rank
        self.col_map = self._column_map()  # output column -> column of lb
        cols = self.native.panel_columns(self.packed) if self.native and self.packed else len(self.col_map)
        self.la = torch.zeros(num_slots, self.max_rank, in_features)
        self.lb = torch.zeros(num_slots, self.max_rank, cols)
        self.ranks = torch.zeros(num_slots, dtype=torch.int32)
        self.rank_of = [0] * num_slots  # the same, as ints, for the PyTorch path

    def _column_map(self) -> torch.Tensor:
        """Where each output column's B row goes in ``lb``: the column itself, except on the
        native GEMM, whose packed panels hold NR columns each and, for a gate/up pair packed
        for the fused SiLU-and-multiply, alternate gate panel q and up panel q."""
        cols = torch.arange(sum(self.part_widths))
        if self.native is None or self.packed is None or not self.packed.silu_mul:
            return cols
        nr, half = self.native.panel_width, self.part_widths[0]
        up = (cols >= half).long()
        c = cols - up * half
        return (2 * (c // nr) + up) * nr + c % nr

    def write(self, slot: int, adapter: LoraAdapter, module: str) -> None:
        """Put ``adapter``'s parts for ``module`` into ``slot`` (zeros where it has none)."""
        self.la[slot].zero_()
        self.lb[slot].zero_()
        offsets = [sum(self.part_widths[:i]) for i in range(len(self.part_widths))]
        r0 = 0
        for part in sorted(adapter.modules.get(module, ()), key=lambda p: p.part):
            r1 = r0 + part.rank
            cols = self.col_map[offsets[part.part] : offsets[part.part] + self.part_widths[part.part]]
            self.la[slot, r0:r1] = part.a
            self.lb[slot, r0:r1, cols] = part.b.T
            r0 = r1
        self.ranks[slot] = r0
        self.rank_of[slot] = r0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = self.step.batch
        if batch is None:
            return self.base(x)
        if self.native is not None and self.packed is not None:
            term = self.native.lora_term(self.packed, batch.row_slot, self.la, self.lb, self.ranks, batch.xa)
            return self.native.gemm(x, self.packed, term)
        quantized = self.base if isinstance(self.base, QuantizedLinear) else None
        y = self.base(x) if quantized is None else quantized.pre_activation(x)  # [rows, out]
        for slot, rows in batch.groups:
            r = self.rank_of[slot]
            if r:
                xa = x.index_select(0, rows).float() @ self.la[slot, :r].T  # [n, r]
                y.index_add_(0, rows, (xa @ self.lb[slot, :r]).to(y.dtype))
        return y if quantized is None else quantized.activate(y)


class LoraSlots:
    """The slot stacks of every wrapped module (module docstring)."""

    def __init__(self, model: Transformer, kernels: NativeKernels | None, *, num_slots: int, max_rank: int) -> None:
        self.num_slots = num_slots
        self.step = LoraStep()
        self.layers: dict[str, LoraLinear] = {}
        args = model.args
        for i in range(args.num_layers):
            for module in NUM_PARTS:
                if module.startswith("mlp.") and args.moe_layers[i]:
                    continue
                name = f"layers.{i}.{module}"
                parent_name, _, attr = name.rpartition(".")
                parent = model.get_submodule(parent_name)
                in_features, widths = module_shapes(args, module)
                layer = LoraLinear(
                    getattr(parent, attr), self.step, num_slots=num_slots, in_features=in_features,
                    part_widths=widths, max_rank=max_rank, kernels=kernels,
                )  # fmt: skip
                setattr(parent, attr, layer)
                self.layers[name] = layer
        self.max_rank = max((layer.max_rank for layer in self.layers.values()), default=0)
        logger.info(
            "LoRA: %d adapter slots of rank <= %d over %d projections, %.1f MiB",
            num_slots,
            max_rank,
            len(self.layers),
            self.nbytes / 2**20,
        )

    @property
    def nbytes(self) -> int:
        return sum(layer.la.numel() * 4 + layer.lb.numel() * 4 for layer in self.layers.values())

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"LoRA slot {slot} out of range ({self.num_slots} slots)")
        unknown = sorted(set(adapter.modules) - self.layers.keys())
        if unknown:
            raise ValueError(f"adapter {adapter.name!r} targets modules the model has no slot for: {unknown[:4]}")
        for name, layer in self.layers.items():
            layer.write(slot, adapter, name)

    def clear(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.la[slot].zero_()
            layer.lb[slot].zero_()
            layer.ranks[slot] = 0
            layer.rank_of[slot] = 0

    def begin_step(self, row_slots: list[int] | None) -> None:
        """The step's slot per row (-1: none), or None when no row uses an adapter."""
        if row_slots is not None and any(not -1 <= s < self.num_slots for s in row_slots):
            raise IndexError(f"a row's LoRA slot is out of range ({self.num_slots} slots)")
        self.step.batch = None if row_slots is None else LoraBatch(row_slots, self.max_rank)

    def end_step(self) -> None:
        self.step.batch = None
