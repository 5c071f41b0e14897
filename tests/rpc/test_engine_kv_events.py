"""Prefix-cache events on the engine's Stream: snapshot on subscribe, stores and evictions per
step, nothing for streams that did not subscribe, every message within its bound.

One engine with a small cache (160 blocks of 16) and a small message limit (16 KiB, so at
most 16384 // 4 // 40 = 102 hashes per message) so that evictions and split messages
happen with prompts of a thousand tokens.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from tandem_common.block_hash import hash_blocks
from tests.rpc.engine_stream import EngineStream, wait_idle
from tests.services import start_engine

BS = 16
MAX_HASHES = 16384 // 4 // 40


@pytest.fixture(scope="module")
def small_engine(demo_model_dir):
    proc = start_engine(
        demo_model_dir,
        "--num-kv-blocks",
        "160",
        "--max-message-bytes",
        "16384",
        "--max-num-batched-tokens",
        "2048",
    )
    try:
        yield proc.wait_serving()
    finally:
        proc.terminate()


@pytest.fixture
async def channel(small_engine):
    async with grpc.aio.insecure_channel(small_engine.address) as ch:
        yield ch


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def _replay(events) -> set[bytes]:
    """The set of cached hashes the events describe, as a frontend would apply them."""
    held: set[bytes] = set()
    for e in events:
        kind = e.WhichOneof("event")
        if kind == "snapshot":
            if e.snapshot.first:
                held.clear()
            held.update(e.snapshot.block_hashes)
        elif kind == "stored":
            held.update(e.stored.block_hashes)
        else:
            held.difference_update(e.removed.block_hashes)
    return held


async def _until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def _snapshot_complete(stream: EngineStream) -> bool:
    return any(e.WhichOneof("event") == "snapshot" and e.snapshot.last for e in stream.kv_events)


async def test_subscriber_sees_snapshot_then_the_blocks_a_request_stores(channel):
    watcher, other = EngineStream(channel), EngineStream(channel)
    try:
        watcher.subscribe_kv_events()
        await _until(lambda: _snapshot_complete(watcher), "the snapshot")
        first = watcher.kv_events[0]
        assert first.WhichOneof("event") == "snapshot" and first.snapshot.first
        before = _replay(watcher.kv_events)

        # Another stream's request: 40 tokens fill two blocks, which the subscriber hears of
        # with the hashes tandem_common computes, chained from no parent.
        prompt = _prompt(1, 40)
        result = other.add("a", prompt, max_tokens=1, temperature=0.0)
        await other.wait("a")
        expected = hash_blocks(prompt, BS)
        await _until(lambda: set(expected) <= _replay(watcher.kv_events), "the stored blocks")
        stored = [e.stored for e in watcher.kv_events if e.WhichOneof("event") == "stored"]
        chain = next(s for s in stored if s.block_hashes[0] == expected[0])
        assert list(chain.block_hashes) == expected and not chain.HasField("parent_block_hash")
        assert result.num_cached_tokens == 0 and other.kv_events == []  # not subscribed: no events

        # A request that hits the first block stores only its own second block, chained to it.
        prompt_b = prompt[:16] + _prompt(2, 24)
        other.add("b", prompt_b, max_tokens=1, temperature=0.0)
        await other.wait("b")
        assert other.results["b"].num_cached_tokens == 16
        hb = hash_blocks(prompt_b, BS)
        await _until(lambda: hb[1] in _replay(watcher.kv_events), "b's block")
        last = [e.stored for e in watcher.kv_events if e.WhichOneof("event") == "stored"][-1]
        assert list(last.block_hashes) == [hb[1]] and last.parent_block_hash == hb[0]

        # A late subscriber's snapshot holds the same set the first one built from events.
        late = EngineStream(channel)
        try:
            late.subscribe_kv_events()
            await _until(lambda: _snapshot_complete(late), "the late snapshot")
            assert _replay(late.kv_events) == _replay(watcher.kv_events) >= before | set(expected) | {hb[1]}
        finally:
            late.cancel()
    finally:
        watcher.cancel()
        other.cancel()
    await wait_idle(watcher.stub)


async def test_evictions_and_big_snapshots_stay_within_the_message_bound(channel):
    watcher = EngineStream(channel)
    late: list[EngineStream] = []
    try:
        watcher.subscribe_kv_events()
        await _until(lambda: _snapshot_complete(watcher), "the snapshot")
        # Two prompts of 1000 tokens cache 124 blocks: more than one message holds.
        p1, p2, p3 = _prompt(10, 1000), _prompt(11, 1000), _prompt(12, 1500)
        for rid, p in (("p1", p1), ("p2", p2)):
            watcher.add(rid, p, max_tokens=1, temperature=0.0)
            await watcher.wait(rid)
        h1, h2, h3 = hash_blocks(p1, BS), hash_blocks(p2, BS), hash_blocks(p3, BS)
        await _until(lambda: set(h1 + h2) <= _replay(watcher.kv_events), "p1's and p2's blocks")

        # A new subscriber gets them as a snapshot in several parts, each within the bound.
        late.append(EngineStream(channel))
        late[0].subscribe_kv_events()
        await _until(lambda: _snapshot_complete(late[0]), "the late snapshot")
        assert len(late[0].kv_hashes_per_message) >= 2
        assert _replay(late[0].kv_events) == _replay(watcher.kv_events)

        # 1500 tokens need 94 of the 160 blocks: p1's blocks, the least recently used, are
        # evicted. That step's evictions and stores together exceed one message: split.
        watcher.add("p3", p3, max_tokens=1, temperature=0.0)
        await watcher.wait("p3")
        await _until(lambda: set(h3) <= _replay(watcher.kv_events), "p3's blocks")
        await _until(lambda: set(h3) <= _replay(late[0].kv_events), "p3's blocks on the late stream")
        removed = {h for e in watcher.kv_events if e.WhichOneof("event") == "removed" for h in e.removed.block_hashes}
        assert set(h1) & removed and not set(h1) <= _replay(watcher.kv_events)
        assert _replay(late[0].kv_events) == _replay(watcher.kv_events)
        for stream in (watcher, late[0]):
            assert max(stream.kv_hashes_per_message) <= MAX_HASHES

        # And the engine's own view, as a third subscriber's snapshot, is what both built.
        late.append(EngineStream(channel))
        late[1].subscribe_kv_events()
        await _until(lambda: _snapshot_complete(late[1]), "the third snapshot")
        assert _replay(late[1].kv_events) == _replay(watcher.kv_events)
    finally:
        for stream in (watcher, *late):
            stream.cancel()
    await wait_idle(watcher.stub)
