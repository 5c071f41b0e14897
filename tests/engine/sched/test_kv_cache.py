"""KVCacheManager: ref counts, free queue, chained prefix hashes, LRU eviction."""

from __future__ import annotations

from engine_svc.sched.kv_cache import KVCacheManager
from engine_svc.sched.request import Request
from engine_svc.types import SamplingParams

BS = 4  # block size in these tests


def make_request(request_id: str, prompt: list[int], **params) -> Request:
    return Request(request_id, prompt, SamplingParams(**params))


def compute(kv: KVCacheManager, request: Request, num_tokens: int | None = None) -> list[int]:
    """Allocate for and 'compute' the request's tokens (all, or num_tokens more), as a step would."""
    blocks, num_hit = kv.get_computed_blocks(request) if request.num_computed_tokens == 0 else ([], 0)
    start = request.num_computed_tokens + num_hit
    remaining = request.num_tokens - start if num_tokens is None else num_tokens
    table = kv.allocate_slots(request, remaining, blocks)
    assert table is not None
    request.num_computed_tokens = start + remaining
    kv.cache_full_blocks(request)
    return table


def test_allocate_and_free_track_ref_counts_and_free_list():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(10)))  # 10 tokens -> 3 blocks
    table = kv.allocate_slots(a, 10)
    assert len(table) == 3 and len(set(table)) == 3
    assert kv.num_free_blocks == 5 and kv.num_used_blocks == 3
    assert kv.usage == 3 / 8
    assert all(kv.blocks[b].ref_count == 1 for b in table)
    assert kv.get_block_ids("a") == table

    # Growing by tokens that still fit the last block takes no new block.
    a.num_computed_tokens = 10
    assert kv.allocate_slots(a, 2) == table
    assert kv.allocate_slots(a, 3) == table + [kv.get_block_ids("a")[-1]]
    assert kv.num_used_blocks == 4

    kv.free(a)
    assert kv.num_free_blocks == 8 and kv.num_used_blocks == 0
    assert kv.get_block_ids("a") == []
    kv.free(a)  # freeing twice is harmless
    assert kv.num_free_blocks == 8


def test_allocate_returns_none_and_changes_nothing_when_pool_is_short():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(8)))
    assert kv.allocate_slots(a, 8) is not None
    b = make_request("b", list(range(100, 108)))
    assert kv.allocate_slots(b, 8) is None
    assert kv.num_free_blocks == 1 and kv.get_block_ids("b") == []
    assert kv.allocate_slots(b, 4) is not None


def test_prefix_hit_follows_the_hash_chain():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    table_a = compute(kv, a)

    # Same first block, different second block: only the first block hits.
    b = make_request("b", [1, 2, 3, 4, 50, 60, 70, 80, 90])
    blocks, num_tokens = kv.get_computed_blocks(b)
    assert (blocks, num_tokens) == (table_a[:1], 4)

    # Same second block behind a different first block: no hit, the chain differs.
    c = make_request("c", [10, 20, 30, 40, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(c) == ([], 0)

    # Same two blocks: both hit, and taking them shares the blocks.
    d = make_request("d", [1, 2, 3, 4, 5, 6, 7, 8, 100, 101])
    blocks, num_tokens = kv.get_computed_blocks(d)
    assert (blocks, num_tokens) == (table_a[:2], 8)
    table_d = kv.allocate_slots(d, 2, blocks)
    assert table_d[:2] == table_a[:2] and table_d[2] not in table_a
    assert [kv.blocks[b].ref_count for b in table_a[:2]] == [2, 2]
    kv.free(a)
    assert [kv.blocks[b].ref_count for b in table_a[:2]] == [1, 1]
    assert kv.num_used_blocks == 3


def test_hit_never_covers_every_token():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(8)))  # exactly two full blocks
    table = compute(kv, a)
    kv.free(a)
    b = make_request("b", list(range(8)))
    # The last token must be computed to get logits, so only the first block may hit.
    assert kv.get_computed_blocks(b) == (table[:1], 4)
    one_block = make_request("c", list(range(4)))
    assert kv.get_computed_blocks(one_block) == ([], 0)


def test_no_hit_without_caching_or_with_prompt_logprobs():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    compute(kv, make_request("a", list(range(9))))
    assert kv.get_computed_blocks(make_request("b", list(range(9)), prompt_logprobs=1)) == ([], 0)
    assert kv.num_queries == 9  # only "a" was looked up

    off = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    compute(off, make_request("a", list(range(9))))
    assert off.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert all(b.block_hash is None for b in off.blocks)


def test_only_full_computed_blocks_are_cached():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(10)))
    table = kv.allocate_slots(a, 10)
    a.num_computed_tokens = 6  # a chunk of 6 tokens: one full block computed
    kv.cache_full_blocks(a)
    assert [kv.blocks[b].block_hash is not None for b in table] == [True, False, False]
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a)
    assert [kv.blocks[b].block_hash is not None for b in table] == [True, True, False]


def test_same_block_computed_twice_keeps_the_first_copy_cached():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a, b = make_request("a", list(range(5))), make_request("b", list(range(5)))
    table_a, table_b = kv.allocate_slots(a, 5), kv.allocate_slots(b, 5)  # neither can hit the other yet
    for r in (a, b):
        r.num_computed_tokens = 5
        kv.cache_full_blocks(r)
    assert kv.blocks[table_a[0]].block_hash is not None
    assert kv.blocks[table_b[0]].block_hash is None
    kv.free(a)
    kv.free(b)
    assert kv.get_computed_blocks(make_request("c", list(range(5))))[0] == table_a[:1]


def test_eviction_takes_least_recently_freed_cached_blocks_first():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", [1, 1, 1, 1, 0])
    b = make_request("b", [2, 2, 2, 2, 0])
    block_a = compute(kv, a)[0]
    block_b = compute(kv, b)[0]
    kv.free(a)  # a's cached block is freed first, so it is evicted first
    kv.free(b)
    # Unhashed blocks are reused before any cached one.
    c = make_request("c", list(range(100, 108)))
    table_c = kv.allocate_slots(c, 8)
    assert block_a not in table_c and block_b not in table_c
    assert kv.get_computed_blocks(make_request("x", [1, 1, 1, 1, 9]))[0] == [block_a]

    # One more block: the front of the queue is a's block, which loses its hash.
    c.num_computed_tokens = 8
    assert kv.allocate_slots(c, 1)[-1] == block_a
    assert kv.blocks[block_a].block_hash is None
    assert kv.get_computed_blocks(make_request("y", [1, 1, 1, 1, 9])) == ([], 0)
    assert kv.get_computed_blocks(make_request("z", [2, 2, 2, 2, 9]))[0] == [block_b]


def test_hit_takes_a_free_cached_block_out_of_the_queue():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5])
    block = compute(kv, a)[0]
    kv.free(a)
    assert kv.num_free_blocks == 3
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    blocks, _ = kv.get_computed_blocks(b)
    assert blocks == [block]
    # 9 tokens need 3 blocks: the hit plus 2 new, so the whole pool, hit included.
    table = kv.allocate_slots(b, 5, blocks)
    assert table[0] == block and kv.num_free_blocks == 0
    assert kv.blocks[block].block_hash is not None and kv.blocks[block].ref_count == 1


def test_hit_on_a_free_block_counts_against_the_free_blocks():
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5])
    block = compute(kv, a)[0]
    kv.free(a)
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # needs 3 blocks, the pool has 2
    blocks, _ = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 5, blocks) is None
    assert kv.num_free_blocks == 2 and kv.blocks[block].ref_count == 0 and kv.blocks[block].block_hash


def test_hit_rate_counts_tokens():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    compute(kv, make_request("a", list(range(9))))  # queried 9, hit 0
    compute(kv, make_request("b", list(range(9))))  # queried 9, hit 8
    assert (kv.num_queries, kv.num_hits) == (18, 8)
    assert kv.prefix_cache_hit_rate == 8 / 18


def test_recompute_after_free_hits_its_own_blocks_including_outputs():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", [1, 2, 3])
    compute(kv, a)
    for t in (4, 5, 6):  # decode: a token appended, then computed
        a.append_output_token(t)
        compute(kv, a, 1)
    a.append_output_token(7)
    table = kv.get_block_ids("a")
    kv.free(a)  # as preemption does
    a.num_computed_tokens = 0
    # 7 tokens: one full block covers prompt and outputs alike.
    assert kv.get_computed_blocks(a) == (table[:1], 4)


# -- prefix-cache events ---------------------------------------------------------------------


def test_no_events_are_recorded_without_a_subscriber():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    compute(kv, make_request("a", list(range(9))))
    assert kv.events is None


def test_events_record_stored_chains_and_evictions_in_order():
    from engine_svc.sched.kv_events import KvEventLog
    from tandem_common.block_hash import hash_blocks
    from tandem_common.kv_events import BlocksRemoved, BlocksStored

    kv = KVCacheManager(num_blocks=3, block_size=BS)
    kv.events = KvEventLog()
    a = make_request("a", list(range(9)))  # two full blocks and one token
    compute(kv, a)
    ha = hash_blocks(a.all_token_ids, BS)
    assert kv.events.take() == [BlocksStored(tuple(ha), None)]
    # A request hitting a's first block stores only its own second block, chained to a's first.
    b = make_request("b", [0, 1, 2, 3, 40, 41, 42, 43, 44])
    kv.free(a)
    compute(kv, b)
    hb = hash_blocks(b.all_token_ids, BS)
    assert hb[0] == ha[0]
    # b takes 2 free blocks: a's partial block, then a's second block, which is evicted.
    assert kv.events.take() == [BlocksRemoved((ha[1],)), BlocksStored((hb[1],), ha[0])]
    assert kv.events.take() == []
    assert set(kv._cached) == {ha[0], hb[1]}


def test_split_events_bounds_batches_and_keeps_the_chain():
    from engine_svc.sched.kv_events import snapshot_events, split_events
    from tandem_common.kv_events import BlocksRemoved, BlocksStored, CacheSnapshot, num_hashes

    h = [bytes([i]) * 32 for i in range(7)]
    events = [BlocksStored(tuple(h[:5]), None), BlocksRemoved(tuple(h[5:]))]
    batches = split_events(events, 2)
    assert [num_hashes(b) for b in batches] == [2, 2, 2, 1]
    assert batches[0] == [BlocksStored((h[0], h[1]), None)]
    assert batches[1] == [BlocksStored((h[2], h[3]), h[1])]
    assert batches[2] == [BlocksStored((h[4],), h[3]), BlocksRemoved((h[5],))]
    assert batches[3] == [BlocksRemoved((h[6],))]
    assert split_events([], 2) == []

    parts = snapshot_events(h[:5], 2)
    assert [p[0].block_hashes for p in parts] == [tuple(h[:2]), tuple(h[2:4]), (h[4],)]
    assert [(p[0].first, p[0].last) for p in parts] == [(True, False), (False, False), (False, True)]
    assert snapshot_events([], 2) == [[CacheSnapshot((), first=True, last=True)]]
