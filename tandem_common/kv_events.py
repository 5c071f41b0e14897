"""Prefix-cache events: what an engine tells subscribed frontends about the blocks it caches.

    engine KV manager ── stored / removed, per step ──▶ Stream (tandem.engine.v1.KvEvent)
                      ── snapshot parts, on subscribe ─▶ frontend PrefixIndex.apply()

Blocks are named by their chained hash (tandem_common/block_hash.py), so a frontend that
hashes a prompt the same way knows how many of its leading blocks an engine holds. Both
services convert these plain values to and from protobuf at their boundaries.

Applying events in order, after a snapshot's first part, reproduces the engine's set of
cached hashes. Replaying events older than the snapshot is harmless: each hash ends in
the state of its latest event either way.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem_common.block_hash import BlockHash


@dataclass(frozen=True)
class BlocksStored:
    """Blocks that entered the prefix cache: a chain, in prompt order, each the parent of the next."""

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None = None  # the parent of block_hashes[0]; None: it starts a prompt


@dataclass(frozen=True)
class BlocksRemoved:
    """Blocks evicted from the prefix cache (their memory went to other tokens)."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class CacheSnapshot:
    """One part of the full set of cached blocks, sent when a stream subscribes.

    ``first``: forget everything known of this engine before adding these; ``last``: the
    snapshot is complete (an empty cache is one part, both first and last).
    """

    block_hashes: tuple[BlockHash, ...]
    first: bool = False
    last: bool = False


KvEvent = BlocksStored | BlocksRemoved | CacheSnapshot


def num_hashes(events: list[KvEvent]) -> int:
    """How many block hashes ``events`` carry: what bounds a message's size."""
    return sum(len(e.block_hashes) for e in events)
