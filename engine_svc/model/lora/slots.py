"""LoRA adapters in numbered slots, and the layers that add their terms per row.

    LoraSlots(model, kernels, num_slots=S, max_rank=r)   wraps every q/k/v/o/gate/up/down
                                                         projection in a LoraLinear
    slots.write(slot, adapter) / slots.clear(slot)       between steps
    with slots.applied(batch): model(...)                 each row adds its request's adapter
    NoLoraSlots()                                         the model without adapters: nothing
                                                          wrapped, ``applied`` does nothing

Each wrapped module keeps one stack per kind, shared by all slots: the parts' lora_A rows
stacked along the ranks (q, k and v: up to 3r of them), their lora_B^T x scale with each
part's columns where the module's output has them, and the ranks each slot uses (its
parts' ranks, summed). On the PyTorch path ``la`` is [S, R, K] and ``lb`` [S, R, N]; on the
native GEMM (gemm_lora.h) ``la`` is [S, K, R] with R in whole vectors and ``lb`` [S, panels,
R, NR] in the packed weight's column order, both in the model's dtype (a bfloat16
model's adapters are read at half the bytes; the products are float32 either way).

A step whose rows use no adapter runs the base layers alone (``lora_rows`` is None): the
wrappers cost one attribute read. Otherwise every row has a slot (-1: the base model) and:

* on the native GEMM the term is added inside the GEMM call (gemm_lora.h): one pass over
  the base weights for every row, each row's rank-R term added to its output tile, before
  the fused SiLU-and-multiply where there is one. Base rows get the same bits as without
  adapters.
* elsewhere (PyTorch, oneDNN, quantized weights) the base layer runs on every row and each
  slot's rows get ``(x @ A^T) @ B^T`` added with ``index_add_`` before the activation.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
from torch import nn

from engine_svc.model.arch.llama import Transformer
from engine_svc.model.backends.native_layers import NativeLinear
from engine_svc.model.backends.quantized_layers import QuantizedLinear
from engine_svc.model.lora.adapter import NUM_PARTS, LoraAdapter, module_shapes
from engine_svc.model.native import NativeKernels
from engine_svc.outputs import ScheduledRequest

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
        self.packed = base.packed if kernels is not None and isinstance(base, NativeLinear) else None
        self.native = kernels if self.packed is not None else None
        self.part_widths = tuple(part_widths)
        num_ranks = max_rank * len(part_widths)  # every part at the largest rank
        self.ranks = torch.zeros(num_slots, dtype=torch.int32)
        self.rank_of = [0] * num_slots  # the same, as ints, for the PyTorch path
        self.col_map = self._column_map()  # output column -> column of lb
        if self.native is not None and self.packed is not None:
            # gemm_lora.h's layout: ranks and columns in panels of NR.
            # In the model's dtype: a bfloat16 model's adapters are read at half the bytes.
            nr, vl, dtype = self.native.panel_width, self.native.vector_width, self.packed.panels.dtype
            num_panels = self.native.panel_columns(self.packed) // nr
            self.max_rank = -(-num_ranks // vl) * vl  # whole vectors
            self.la = torch.zeros(num_slots, in_features, self.max_rank, dtype=dtype)  # [S, K, R]
            self.lb = torch.zeros(num_slots, num_panels, self.max_rank, nr, dtype=dtype)  # [S, NP, R, NR]
            self.spans = torch.zeros(num_slots, num_panels, 2, dtype=torch.int32)  # [S, NP, (t0, t1)]
            self.term = self.native.lora_term(self.packed, self.la, self.lb, self.ranks, self.spans)
        else:
            self.max_rank = num_ranks
            self.la = torch.zeros(num_slots, num_ranks, in_features)  # [S, R, K]
            self.lb = torch.zeros(num_slots, num_ranks, len(self.col_map))  # [S, R, N]
            self.spans = torch.zeros(0, dtype=torch.int32)  # the native GEMM's only

    def _column_map(self) -> torch.Tensor:
        """Where each output column's B row goes: the column itself, except on the native
        GEMM, whose packed panels hold NR columns each and, for a gate/up pair packed for the
        fused SiLU-and-multiply, alternate gate panel q and up panel q."""
        cols = torch.arange(sum(self.part_widths))
        if self.native is None or self.packed is None or not self.packed.silu_mul:
            return cols
        nr, half = self.native.panel_width, self.part_widths[0]
        up = (cols >= half).long()
        c = cols - up * half
        return (2 * (c // nr) + up) * nr + c % nr

    def write(self, slot: int, adapter: LoraAdapter, module: str) -> None:
        """Put ``adapter``'s parts for ``module`` into ``slot`` (zeros where it has none): its
        parts' A rows stacked, and their B columns where the parts' outputs are."""
        la = torch.zeros(self.max_rank, self.la.shape[1] if self.native else self.la.shape[-1])  # [R, K]
        lb = torch.zeros(self.max_rank, int(self.col_map.max()) + 1)  # [R, columns]
        offsets = [sum(self.part_widths[:i]) for i in range(len(self.part_widths))]
        spans: list[tuple[torch.Tensor, int, int]] = []  # (the part's columns, its ranks t0, t1)
        r0 = 0
        for part in sorted(adapter.modules.get(module, ()), key=lambda p: p.part):
            r1 = r0 + part.rank
            cols = self.col_map[offsets[part.part] : offsets[part.part] + self.part_widths[part.part]]
            la[r0:r1] = part.a
            lb[r0:r1, cols] = part.b.T
            spans.append((cols, r0, r1))
            r0 = r1
        if self.native is not None:
            nr = self.lb.shape[-1]
            self.la[slot] = la.T
            num_panels = self.lb.shape[1]
            lb = torch.nn.functional.pad(lb, (0, num_panels * nr - lb.shape[1]))
            self.lb[slot] = lb.view(self.max_rank, num_panels, nr).transpose(0, 1)
            # Each weight panel adds only the ranks of the parts its columns belong to.
            t0 = torch.full((num_panels,), self.max_rank, dtype=torch.int32)
            t1 = torch.zeros(num_panels, dtype=torch.int32)
            for cols, start, end in spans:
                panels = torch.unique(cols // nr)
                t0[panels] = torch.clamp(t0[panels], max=start)
                t1[panels] = torch.clamp(t1[panels], min=end)
            self.spans[slot] = torch.stack((torch.minimum(t0, t1), t1), dim=1)
        else:
            self.la[slot] = la
            self.lb[slot] = lb
        self.ranks[slot] = r0
        self.rank_of[slot] = r0

    def clear(self, slot: int) -> None:
        self.la[slot].zero_()
        self.lb[slot].zero_()
        if self.native is not None:
            self.spans[slot].zero_()
        self.ranks[slot] = 0
        self.rank_of[slot] = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = self.step.batch
        if batch is None:
            return self.base(x)
        if self.native is not None and self.packed is not None:
            if batch.row_slot.shape[0] != x.shape[0]:
                raise ValueError(f"LoRA rows: {batch.row_slot.shape[0]} slots for {x.shape[0]} rows")
            return self.native.gemm(x, self.packed, self.term.for_rows(batch.row_slot, batch.xa))
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
        if model.decode_stack is not None:
            logger.info("LoRA: the decode stack is off (its native code has no adapter terms): layers run one by one")
        model.decode_stack = None
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
            layer.clear(slot)

    def begin_step(self, row_slots: list[int] | None) -> None:
        """The step's slot per row (-1: none), or None when no row uses an adapter."""
        if row_slots is not None and any(not -1 <= s < self.num_slots for s in row_slots):
            raise IndexError(f"a row's LoRA slot is out of range ({self.num_slots} slots)")
        self.step.batch = None if row_slots is None else LoraBatch(row_slots, self.max_rank)

    def end_step(self) -> None:
        self.step.batch = None

    @contextlib.contextmanager
    def applied(self, batch: Sequence[ScheduledRequest]) -> Iterator[None]:
        """While the model runs over ``batch``, each row adds its request's adapter."""
        self.begin_step(lora_rows(batch))
        try:
            yield
        finally:
            self.end_step()


class NoLoraSlots:
    """The model without adapter slots (no --enable-lora): its layers are not wrapped."""

    num_slots = 0

    def applied(self, batch: Sequence[ScheduledRequest]) -> AbstractContextManager[None]:
        return contextlib.nullcontext()


def lora_rows(batch: Sequence[ScheduledRequest]) -> list[int] | None:
    """Each row's LoRA slot (-1: the base model), in batch order; None if no row has one."""
    if all(s.request.lora_slot is None for s in batch):
        return None
    rows: list[int] = []
    for s in batch:
        slot = s.request.lora_slot
        rows += [-1 if slot is None else slot] * s.num_scheduled_tokens
    return rows
