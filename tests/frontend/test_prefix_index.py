"""PrefixIndex: stored / removed / snapshot events, engine removal, exact prefix lookups."""

from __future__ import annotations

from frontend_svc.engine.prefix_index import PrefixIndex
from tandem_common.block_hash import hash_blocks
from tandem_common.kv_events import BlocksRemoved, BlocksStored, CacheSnapshot

BS = 4
PROMPT = list(range(100, 124))  # six blocks of 4
H = hash_blocks(PROMPT, BS)


def test_stored_blocks_are_found_as_a_leading_run_per_engine():
    index = PrefixIndex()
    index.apply("a", [BlocksStored(tuple(H[:4]))])
    index.apply("b", [BlocksStored(tuple(H[:2]))])
    assert index.match(H) == {"a": 4, "b": 2}
    assert index.match(H[:3]) == {"a": 3, "b": 2}
    assert index.engines_holding(H[1]) == {"a", "b"} and index.engines_holding(H[3]) == {"a"}
    assert index.num_blocks("a") == 4 and index.num_blocks("nobody") == 0


def test_lookup_stops_at_the_first_block_an_engine_lacks():
    index = PrefixIndex()
    # b holds blocks 0, 1 and 3: the run stops at 2, as the engine's own lookup would.
    index.apply("b", [BlocksStored((H[0], H[1])), BlocksStored((H[3],), H[2])])
    assert index.match(H) == {"b": 2}
    # c holds later blocks only: without the first, nothing of the prompt is servable.
    index.apply("c", [BlocksStored(tuple(H[1:]), H[0])])
    assert "c" not in index.match(H)
    # Another prompt sharing only the first block matches one block.
    other = hash_blocks(PROMPT[:4] + [9] * 8, BS)
    assert other[0] == H[0] and index.match(other) == {"b": 1}
    assert index.match([]) == {} and index.match(hash_blocks([7] * 8, BS)) == {}


def test_removed_blocks_shorten_the_run_and_events_apply_in_order():
    index = PrefixIndex()
    index.apply("a", [BlocksStored(tuple(H)), BlocksRemoved((H[4], H[5]))])
    assert index.match(H) == {"a": 4}
    # Evicted then stored again within one batch: held; stored then evicted: not held.
    index.apply("a", [BlocksRemoved((H[2],)), BlocksStored((H[2],), H[1]), BlocksStored((H[4],), H[3])])
    index.apply("a", [BlocksRemoved((H[4],))])
    assert index.match(H) == {"a": 4}
    index.apply("a", [BlocksRemoved((H[0],))])
    assert index.match(H) == {}
    index.apply("a", [BlocksRemoved((b"unknown" * 4,))])  # an unknown hash is ignored
    index.apply("x", [BlocksRemoved((H[0],))])  # so is an unknown engine
    assert index.engines == ["a"]


def test_snapshot_replaces_what_was_known_of_the_engine():
    index = PrefixIndex()
    index.apply("a", [BlocksStored(tuple(H))])
    index.apply("b", [BlocksStored(tuple(H[:3]))])
    assert not index.synced("a")
    index.apply("a", [CacheSnapshot((H[0],), first=True)])
    assert index.match(H) == {"a": 1, "b": 3} and not index.synced("a")
    index.apply("a", [CacheSnapshot((H[1], H[2]), last=True)])
    assert index.match(H) == {"a": 3, "b": 3} and index.synced("a")
    # An empty cache is one part, first and last.
    index.apply("a", [CacheSnapshot((), first=True, last=True)])
    assert index.match(H) == {"b": 3} and index.synced("a") and index.num_blocks("a") == 0


def test_removing_an_engine_forgets_it_and_only_it():
    index = PrefixIndex()
    index.apply("a", [CacheSnapshot(tuple(H), first=True, last=True)])
    index.apply("b", [BlocksStored(tuple(H[:2]))])
    index.remove_engine("a")
    assert index.match(H) == {"b": 2}
    assert index.engines_holding(H[3]) == set() and not index.synced("a")
    assert index.engines == ["b"]
    index.remove_engine("a")  # twice is harmless
    # A new engine reuses the freed slot without inheriting anything.
    index.apply("c", [BlocksStored((H[0],))])
    assert index.match(H) == {"b": 2, "c": 1}
    index.remove_engine("b")
    index.remove_engine("c")
    assert index.match(H) == {} and index._holders == {}


def test_an_engine_holds_at_most_its_pool_and_the_excess_is_counted():
    index = PrefixIndex()
    index.set_capacity("a", 4)
    index.apply("a", [CacheSnapshot(tuple(H), first=True, last=True)])  # six hashes, pool of four
    assert index.num_blocks("a") == 4 and index.num_dropped == 2
    assert index.match(H) == {"a": 4}
    # Room made by an eviction is used again; a hash already held is never dropped.
    index.apply("a", [BlocksRemoved((H[3],)), BlocksStored((H[0], H[4]))])
    assert index.num_blocks("a") == 4 and index.num_dropped == 2
    index.set_capacity("b", 0)  # names no pool: the fixed bound
    index.apply("b", [BlocksStored(tuple(H))])
    assert index.num_blocks("b") == 6
