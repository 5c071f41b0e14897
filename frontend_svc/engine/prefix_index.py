"""Which engines hold which prefix-cache blocks, from the events the engines publish.

    EngineClient ── apply(engine, events) ──▶ PrefixIndex: block hash -> engines holding it
    EngineRouter ── match(prompt hashes) ──▶ {engine: leading blocks it holds}
    EngineClient ── remove_engine(engine) when its stream ends

A block hash covers every token before it (tandem_common/block_hash.py), so an engine that
holds the hash of a prompt's third block holds the prompt's first three blocks' worth of
K/V, as long as it also holds the first two; the lookup walks the prompt's hashes from the
first and stops, per engine, at the first it lacks, as the engine's own lookup does.

Memory: one dict entry per distinct hash (an int bitmask of engines) plus one set entry
per (engine, hash), about 150 bytes per cached block per engine. An engine with 1 GiB of
KV at 16 tokens a block can hold ~65k blocks: ~10 MB of index per such engine.

Bound: an engine cannot cache more blocks than its pool has, so the index holds at most
the ``num_kv_blocks`` its model info reports (``set_capacity``), and never more than
MAX_BLOCKS_PER_ENGINE (~150 MB), which also bounds an engine that reports none or an
absurd pool. Hashes past the bound are dropped, counted (``num_dropped``, a metric) and
warned about once per session: whatever speaks the engine protocol cannot make the
frontend's memory grow without limit. Dropped hashes only cost predictions.
No grpc here: the client converts the engine's protobuf events into tandem_common values.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from tandem_common.block_hash import BlockHash
from tandem_common.kv_events import BlocksRemoved, BlocksStored, CacheSnapshot, KvEvent

logger = logging.getLogger(__name__)

MAX_BLOCKS_PER_ENGINE = 1 << 20  # whatever an engine reports: ~150 MB of index at most


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[BlockHash, int] = {}  # block hash -> bitmask of engine slots
        self._blocks: dict[str, set[BlockHash]] = {}  # engine -> the hashes it holds
        self._slots: dict[str, int] = {}  # engine -> its bit
        self._synced: set[str] = set()  # engines whose snapshot arrived whole
        self._capacity: dict[str, int] = {}  # engine -> most hashes kept of it
        self._warned: set[str] = set()  # engines told about dropped hashes this session
        self.num_dropped = 0  # hashes dropped past an engine's capacity, ever

    def set_capacity(self, engine: str, num_kv_blocks: int) -> None:
        """Keep at most ``num_kv_blocks`` hashes of ``engine`` (its pool; 0: it names none)."""
        self._capacity[engine] = (
            min(num_kv_blocks, MAX_BLOCKS_PER_ENGINE) if num_kv_blocks > 0 else MAX_BLOCKS_PER_ENGINE
        )

    # -- updates ---------------------------------------------------------------------------

    def apply(self, engine: str, events: Iterable[KvEvent]) -> None:
        """Apply one engine's events, in the order it sent them."""
        for event in events:
            if isinstance(event, BlocksStored):
                self._add(engine, event.block_hashes)
            elif isinstance(event, BlocksRemoved):
                self._discard(engine, event.block_hashes)
            elif isinstance(event, CacheSnapshot):
                if event.first:
                    self.remove_engine(engine)
                self._add(engine, event.block_hashes)
                if event.last:
                    self._synced.add(engine)

    def remove_engine(self, engine: str) -> None:
        """Forget everything ``engine`` held (its stream ended; a new one starts from a snapshot)."""
        hashes = self._blocks.pop(engine, set())
        self._synced.discard(engine)
        self._warned.discard(engine)
        slot = self._slots.pop(engine, None)
        if slot is None:
            return
        bit = 1 << slot
        for h in hashes:
            mask = self._holders[h] & ~bit
            if mask:
                self._holders[h] = mask
            else:
                del self._holders[h]

    # -- lookups ---------------------------------------------------------------------------

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """For each engine that holds the first block: how many leading blocks it holds."""
        if not block_hashes or (mask := self._holders.get(block_hashes[0], 0)) == 0:
            return {}
        depth: dict[int, int] = {}
        for i, h in enumerate(block_hashes[1:], start=1):
            still = mask & self._holders.get(h, 0)
            for slot in _bits(mask & ~still):
                depth[slot] = i
            mask = still
            if not mask:
                break
        for slot in _bits(mask):
            depth[slot] = len(block_hashes)
        engine_of = {slot: engine for engine, slot in self._slots.items()}
        return {engine_of[slot]: n for slot, n in depth.items()}

    def engines_holding(self, block_hash: BlockHash) -> set[str]:
        mask = self._holders.get(block_hash, 0)
        return {engine for engine, slot in self._slots.items() if mask >> slot & 1}

    def num_blocks(self, engine: str) -> int:
        return len(self._blocks.get(engine, ()))

    def synced(self, engine: str) -> bool:
        """True once the engine's whole snapshot arrived (until its stream ends)."""
        return engine in self._synced

    @property
    def engines(self) -> list[str]:
        return list(self._blocks)

    # -- internals -------------------------------------------------------------------------

    def _slot(self, engine: str) -> int:
        slot = self._slots.get(engine)
        if slot is None:
            used = set(self._slots.values())
            slot = next(i for i in range(len(used) + 1) if i not in used)
            self._slots[engine] = slot
            self._blocks[engine] = set()
        return slot

    def _add(self, engine: str, hashes: Iterable[BlockHash]) -> None:
        bit = 1 << self._slot(engine)
        held = self._blocks[engine]
        holders = self._holders
        capacity = self._capacity.get(engine, MAX_BLOCKS_PER_ENGINE)
        dropped = 0
        for h in hashes:
            if len(held) >= capacity and h not in held:
                dropped += 1
                continue
            held.add(h)
            holders[h] = holders.get(h, 0) | bit
        if dropped:
            self.num_dropped += dropped
            if engine not in self._warned:
                self._warned.add(engine)
                logger.warning(
                    "engine %s published more prefix-cache blocks than the %d its pool holds; %d dropped "
                    "(tandem_frontend_prefix_index_dropped_blocks counts them), routing predicts fewer hits to it",
                    engine,
                    capacity,
                    dropped,
                )

    def _discard(self, engine: str, hashes: Iterable[BlockHash]) -> None:
        slot = self._slots.get(engine)
        if slot is None:
            return
        bit = 1 << slot
        held = self._blocks[engine]
        for h in hashes:
            if h in held:
                held.discard(h)
                mask = self._holders[h] & ~bit
                if mask:
                    self._holders[h] = mask
                else:
                    del self._holders[h]


def _bits(mask: int) -> Iterable[int]:
    slot = 0
    while mask:
        if mask & 1:
            yield slot
        mask >>= 1
        slot += 1
