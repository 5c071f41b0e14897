"""The KV manager's record of what its prefix cache stored and evicted, for subscribers.

    KVCacheManager.cache_full_blocks ── stored(parent, hash) ──▶ KvEventLog
    KVCacheManager._pop_free_block   ── removed(hash) ─────────▶     │ take(), once per turn
                                                        engine loop ◀┘ ── bounded batches ──▶ streams

The log exists only while a stream subscribes (``KVCacheManager.events`` is None
otherwise), so an engine nobody listens to records nothing. Consecutive stores of one
chain become one ``BlocksStored`` and consecutive evictions one ``BlocksRemoved``, so a
step's events stay few however many blocks it touches.
"""

from __future__ import annotations

from collections.abc import Iterable

from tandem_common.block_hash import BlockHash
from tandem_common.kv_events import BlocksRemoved, BlocksStored, CacheSnapshot, KvEvent


class KvEventLog:
    def __init__(self) -> None:
        # (parent, hashes) for a run of stores, (None, hashes) with removed=True for evictions
        self._runs: list[tuple[bool, BlockHash | None, list[BlockHash]]] = []

    def stored(self, parent_hash: BlockHash | None, block_hash: BlockHash) -> None:
        if self._runs:
            removed, _, hashes = self._runs[-1]
            if not removed and hashes[-1] == parent_hash:
                hashes.append(block_hash)
                return
        self._runs.append((False, parent_hash, [block_hash]))

    def removed(self, block_hash: BlockHash) -> None:
        if self._runs and self._runs[-1][0]:
            self._runs[-1][2].append(block_hash)
        else:
            self._runs.append((True, None, [block_hash]))

    def take(self) -> list[KvEvent]:
        """The events since the last call, in the order they happened."""
        runs, self._runs = self._runs, []
        return [
            BlocksRemoved(tuple(hashes)) if removed else BlocksStored(tuple(hashes), parent)
            for removed, parent, hashes in runs
        ]


def split_events(events: list[KvEvent], max_hashes: int) -> list[list[KvEvent]]:
    """``events`` cut into batches of at most ``max_hashes`` hashes each, order kept.

    A long stored chain is cut into parts, each part's parent being the last hash of the
    part before, so every batch fits a stream message of a known size.
    """
    assert max_hashes > 0
    batches: list[list[KvEvent]] = [[]]
    room = max_hashes
    for event in events:
        hashes = event.block_hashes
        while hashes:
            if room == 0:
                batches.append([])
                room = max_hashes
            part, hashes = hashes[:room], hashes[room:]
            room -= len(part)
            if isinstance(event, BlocksStored):
                batches[-1].append(BlocksStored(part, event.parent_hash))
                event = BlocksStored(hashes, part[-1])
            else:
                batches[-1].append(BlocksRemoved(part))
    return [b for b in batches if b]


def snapshot_events(cached: Iterable[BlockHash], max_hashes: int) -> list[list[KvEvent]]:
    """The whole cache as ``CacheSnapshot`` parts of at most ``max_hashes`` hashes, one per batch."""
    hashes = tuple(cached)
    parts = [hashes[i : i + max_hashes] for i in range(0, len(hashes), max_hashes)] or [()]
    return [[CacheSnapshot(part, first=i == 0, last=i == len(parts) - 1)] for i, part in enumerate(parts)]
