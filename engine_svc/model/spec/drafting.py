"""A draft model's place in the runner: a wrapper around the target's step, or none.

    runner.execute(): ordered batch -> drafter.step(batch, target_step) -> ModelRunnerOutput

    DraftModel.step   fill the MODEL_DRAFT slots (its own passes), run target_step on the
                      filled batch with the drafts' distributions, then move its cache to
                      the accepted tokens (``drafter.py``)
    NoDraftModel.step target_step(batch): prompt lookup's drafts, or none, are in the batch
                      already

Its KV blocks are the target's block ids in its own tensors, so the runner sizes and
allocates the two pools together through ``bytes_per_block``, ``allocate`` and
``kv_caches`` (nothing, without a draft model).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Protocol

from engine_svc.model.attention import KVCache
from engine_svc.model.sample.sampler import Proposal
from engine_svc.outputs import ModelRunnerOutput, ScheduledRequest

# The target's step over a batch, with the draft model's distributions for its drafts, by
# request (rows without one verify a draft as equal-or-not: ``verify.py``).
TargetStep = Callable[[list[ScheduledRequest], dict[str, list[Proposal]]], ModelRunnerOutput]


class Drafter(Protocol):
    bytes_per_block: int  # its KV bytes per block of the target's pool
    kv_caches: list[KVCache]

    def allocate(self, num_blocks: int) -> None: ...

    def forget(self, request_ids: Collection[str]) -> None: ...

    def step(self, batch: list[ScheduledRequest], target_step: TargetStep) -> ModelRunnerOutput: ...

    def time_passes(self, sizes: list[int], context: int, budget_s: float) -> list[tuple[int, float]]:
        """(rows, seconds) of its passes by rows, before serving (speculative decoding's costs)."""
        ...


class NoDraftModel:
    """The runner without a draft model: the target's step as it is."""

    bytes_per_block = 0

    def __init__(self) -> None:
        self.kv_caches: list[KVCache] = []

    def allocate(self, num_blocks: int) -> None:
        pass

    def forget(self, request_ids: Collection[str]) -> None:
        pass

    def step(self, batch: list[ScheduledRequest], target_step: TargetStep) -> ModelRunnerOutput:
        return target_step(batch, {})

    def time_passes(self, sizes: list[int], context: int, budget_s: float) -> list[tuple[int, float]]:
        return []
