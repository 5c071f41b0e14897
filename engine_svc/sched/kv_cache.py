"""KV cache block manager: a pool of fixed-size blocks with automatic prefix caching.

No torch here: this class only hands out block ids. The model runner owns the tensors
and turns a block table into slot numbers.

    request.all_token_ids (block_size = 4)
    +-------------+-------------+-------------+---------+
    | t0 t1 t2 t3 | t4 t5 t6 t7 | t8 ... t11  | t12 t13 |   <- the last block may be partial
    +-------------+-------------+-------------+---------+
          |             |             |            |
    hash  h0            h1            h2           (none: not full)
          |             |             |            |
    block table [ 7,            2,            9,           4 ]       one per request
          |             |             |            |
    block pool  [0] [1] [2] [3] [4] [5] [6] [7] [8] [9] ...          num_blocks blocks

    h0 = H(-, t0..t3)   h1 = H(h0, t4..t7)   h2 = H(h1, t8..t11)
    slot of token i = table[i // block_size] * block_size + i % block_size

Prefix caching: a block whose tokens are all computed gets a hash chained over every
token before it, so equal hashes mean equal prefixes, not just equal blocks. Another
request whose prompt starts with the same tokens reuses those blocks (ref_count > 1)
instead of recomputing them.

Within a step: the scheduler registers the blocks a step's chunk will fill before the
step runs (``cache_full_blocks(request, num_tokens)``), so that a request admitted later
in the same step hits them instead of computing the same prefix again: every layer
writes the whole step's K/V before any of its attention reads the cache, so the hit
request reads them in the same pass. Those registrations are the step's until the next
``begin_step``; ``revert_step`` forgets them when the step failed and wrote nothing.

Free queue (LRU): every block with ref_count == 0 sits in one ordered queue; allocation
takes from the front. A freed block that carries a hash goes to the back and keeps its
hash, so it can still be hit until the front reaches it (then it is evicted: the hash is
dropped and the block reused). A hit on a free block takes it back out of the queue.
Freed blocks without a hash go to the front: they hold nothing worth keeping.

The hash itself is defined once for both services in ``tandem_common/block_hash.py``; a
frontend computes the same hashes from a prompt to predict which engine holds it. While a
stream subscribes to prefix-cache events, ``events`` records every hash registered and
evicted (``sched/kv_events.py``); otherwise it is None and nothing is recorded.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine_svc.sched.kv_events import KvEventLog
from engine_svc.sched.request import Request
from tandem_common.block_hash import BlockHash, hash_blocks, max_hit_blocks

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    # Set once the block is full and computed and registered in the cache; a block has a
    # hash exactly when it is the one block the cache maps that hash to.
    block_hash: BlockHash | None = None


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Invariant: a block is in the free queue exactly when its ref_count is 0.
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}  # block hash -> block id
        self._tables: dict[str, list[int]] = {}  # request id -> block table
        self._block_hashes: dict[str, list[BlockHash]] = {}  # request id -> hashes of its full blocks
        # request id -> how many leading blocks of its table cache_full_blocks has handled
        self._num_handled_blocks: dict[str, int] = {}
        # Hit-rate counters, in tokens: queried = prompt tokens looked up, hit = served from cache.
        self.num_queries = 0
        self.num_hits = 0
        self.events: KvEventLog | None = None  # set while a stream subscribes to cache events
        # Blocks registered ahead of the step being scheduled (their K/V not yet written).
        self._ahead: list[int] = []

    # -- figures ----------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0

    def get_block_ids(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, ()))

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash the prefix cache holds now: the snapshot that ``events`` continue."""
        return list(self._cached)

    # -- paired verbs -----------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest run of cached blocks that matches the start of ``request``'s tokens.

        Returns (block_ids, num_tokens). Takes no references: pass the blocks straight to
        ``allocate_slots`` before anything else allocates. The hit stops short of the last
        token, so at least one token is computed and there are logits to sample from.
        """
        if not self.enable_prefix_caching:
            return [], 0
        num_blocks = max_hit_blocks(
            request.num_tokens, self.block_size, prompt_logprobs=request.sampling_params.prompt_logprobs is not None
        )
        if num_blocks == 0:
            return [], 0
        hit: list[int] = []
        for block_hash in self._hashes(request, num_blocks)[:num_blocks]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hit.append(block_id)
        num_hit_tokens = len(hit) * self.block_size
        self.num_queries += request.num_tokens
        self.num_hits += num_hit_tokens
        return hit, num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """Grow ``request``'s block table to hold its computed tokens, the tokens of
        ``new_computed_blocks`` (prefix hits, appended first) and ``num_new_tokens`` more.

        Returns a copy of the whole block table, or None, changing nothing, when the free
        blocks don't suffice.
        """
        table = self._tables.get(request.request_id, [])
        if new_computed_blocks:
            # Hits only ever start a table: they are looked up before the first chunk.
            assert not table and request.num_computed_tokens == 0, request
        num_tokens = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        num_needed = -(-num_tokens // self.block_size) - len(table) - len(new_computed_blocks)
        # Hit blocks sitting in the free queue stop being free once referenced.
        num_free_hits = sum(1 for b in new_computed_blocks if self.blocks[b].ref_count == 0)
        if num_needed > self.num_free_blocks - num_free_hits:
            return None
        for block_id in new_computed_blocks:
            self._take_ref(block_id)
        table.extend(new_computed_blocks)
        table.extend(self._pop_free_block() for _ in range(num_needed))
        self._tables[request.request_id] = table
        if new_computed_blocks:
            self._num_handled_blocks[request.request_id] = len(new_computed_blocks)
        return list(table)

    def cache_full_blocks(self, request: Request, num_tokens: int | None = None) -> None:
        """Register the hashes of blocks that became full and computed since the last call.

        Call after ``request.num_computed_tokens`` moved forward; only blocks whose K/V is
        written may be hit by others. Or, while a step is scheduled, with ``num_tokens``:
        the tokens whose K/V that step writes (computed ones and its chunk's), so that
        requests admitted after it in the same step hit the blocks it fills.
        """
        if not self.enable_prefix_caching:
            return
        request_id = request.request_id
        table = self._tables.get(request_id)
        if not table:
            return
        ahead = num_tokens is not None
        written = request.num_computed_tokens if num_tokens is None else num_tokens
        num_full = min(written // self.block_size, len(table))
        start = self._num_handled_blocks.get(request_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes(request, num_full)
        for i in range(start, num_full):
            block = self.blocks[table[i]]
            # If another request computed the same block first, that copy stays the cached
            # one; this block keeps no hash and is reused as soon as it is freed.
            if block.block_hash is None and hashes[i] not in self._cached:
                block.block_hash = hashes[i]
                self._cached[hashes[i]] = block.block_id
                if ahead:
                    self._ahead.append(block.block_id)
                if self.events is not None:
                    self.events.stored(hashes[i - 1] if i else None, hashes[i])
        self._num_handled_blocks[request_id] = num_full

    def begin_step(self) -> None:
        """A new step is being scheduled: the last one's blocks registered ahead are written."""
        self._ahead.clear()

    def revert_step(self) -> None:
        """The scheduled step failed: forget the blocks registered ahead of it, whose K/V
        was never written (their requests are failed and free them; nobody may hit them)."""
        for block_id in self._ahead:
            block = self.blocks[block_id]
            if block.block_hash is None or self._cached.get(block.block_hash) != block_id:
                continue  # evicted since
            del self._cached[block.block_hash]
            if self.events is not None:
                self.events.removed(block.block_hash)
            block.block_hash = None
            if block.ref_count == 0:  # nothing worth keeping: reused first
                self._free_queue.move_to_end(block_id, last=False)
        self._ahead.clear()

    def free(self, request: Request) -> None:
        """Drop ``request``'s references. Cached blocks stay hittable until evicted."""
        request_id = request.request_id
        self._block_hashes.pop(request_id, None)
        self._num_handled_blocks.pop(request_id, None)
        table = self._tables.pop(request_id, None)
        if not table:
            return
        # Tail first: the end of a prompt is the part least likely to be shared, so it
        # should be evicted before the head (evicting a head orphans its tail anyway).
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, block
            if block.ref_count == 0:
                self._free_queue[block_id] = None
                if block.block_hash is None:
                    self._free_queue.move_to_end(block_id, last=False)

    # -- internals ----------------------------------------------------------------------

    def _hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """Hashes of the request's first ``num_blocks`` full blocks, extended on demand.

        A request's tokens are only ever appended, so hashes once computed stay valid.
        """
        hashes = self._block_hashes.setdefault(request.request_id, [])
        if num_blocks > len(hashes):
            start = len(hashes) * self.block_size
            tokens = request.all_token_ids[start : num_blocks * self.block_size]
            hashes.extend(
                hash_blocks(tokens, self.block_size, parent_hash=hashes[-1] if hashes else request.cache_salt)
            )
        return hashes

    def _take_ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free_queue[block_id]
        block.ref_count += 1

    def _pop_free_block(self) -> int:
        block_id, _ = self._free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict: the block's old contents are overwritten
            del self._cached[block.block_hash]
            if self.events is not None:
                self.events.removed(block.block_hash)
            block.block_hash = None
        block.ref_count = 1
        return block_id
