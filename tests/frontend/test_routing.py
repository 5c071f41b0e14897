"""The routing policy (routing.py) and EngineRouter.route(): prefix hits against load."""

from __future__ import annotations

import threading

import pytest

from frontend_svc.engine import router as router_module
from frontend_svc.engine.client import EngineClient
from frontend_svc.engine.router import EngineRouter, PromptBlocks
from frontend_svc.engine.routing import Candidate, RoutingPolicy, RoutingReason, choose_by_prefix, least_loaded
from tandem_common.block_hash import hash_blocks
from tandem_common.kv_events import BlocksRemoved, BlocksStored, CacheSnapshot
from tandem_protos.tandem.engine.v1 import engine_pb2
from tests.frontend.test_engine_router import _client

PROMPT = list(range(500, 600))  # 100 tokens: 6 full blocks of 16, at most 6 can hit


def test_prefix_policy_prefers_the_longest_hit_within_the_load_band():
    cands = [Candidate(load_tokens=500, hit_tokens=64), Candidate(load_tokens=0, hit_tokens=16), Candidate(300)]
    assert choose_by_prefix(cands, threshold_tokens=500) == (0, RoutingReason.PREFIX_HIT)
    # 500 tokens above the least loaded is outside a band of 499: the best hit inside it wins.
    assert choose_by_prefix(cands, threshold_tokens=499) == (1, RoutingReason.LOAD_FALLBACK)
    # Equal hits: the less loaded.
    assert choose_by_prefix([Candidate(90, 64), Candidate(80, 64)], 1000) == (1, RoutingReason.PREFIX_HIT)


def test_without_any_hit_the_emptiest_cache_in_band_then_the_least_loaded_wins():
    # A new prefix goes where the cache holds least, so prefixes spread over the caches...
    cands = [Candidate(10, 0, num_cached_blocks=0), Candidate(5, 0, num_cached_blocks=50)]
    assert choose_by_prefix(cands, 100) == (0, RoutingReason.NO_HIT)
    # ... among engines within the load band only.
    assert choose_by_prefix(cands, 4) == (1, RoutingReason.NO_HIT)
    tied = [Candidate(9, 0, num_cached_blocks=3), Candidate(0, 0, num_cached_blocks=3)]
    assert all(choose_by_prefix(tied, 100) == (1, RoutingReason.NO_HIT) for _ in range(20))
    assert {least_loaded([Candidate(0), Candidate(0)]) for _ in range(64)} == {0, 1}  # ties at random


async def test_route_sends_a_prompt_to_the_engine_holding_its_prefix():
    router = EngineRouter([], policy=RoutingPolicy.PREFIX, load_threshold_tokens=1000)
    a = _client(router, "a:1", used_blocks=10)  # 160 tokens of load
    b = _client(router, "b:1")
    hashes = hash_blocks(PROMPT, 16)
    router.index.apply("a:1", [CacheSnapshot(tuple(hashes[:4]), first=True, last=True)])
    route = await router.route(PromptBlocks(PROMPT))
    assert (route.client, route.reason, route.predicted_cached_tokens) == (a, RoutingReason.PREFIX_HIT, 64)

    # The whole prompt held: the prediction stops short of the last token (6 blocks, not 6.25).
    router.index.apply("a:1", [BlocksStored(tuple(hashes[4:]), hashes[3])])
    assert (await router.route(PromptBlocks(PROMPT))).predicted_cached_tokens == 96
    assert (await router.route(PromptBlocks(PROMPT[:97]))).predicted_cached_tokens == 96
    assert (await router.route(PromptBlocks(PROMPT[:96]))).predicted_cached_tokens == 80
    # Prompt logprobs hit nothing in the engine: predicted 0, and load decides.
    route = await router.route(PromptBlocks(PROMPT, prompt_logprobs=True))
    assert (route.client, route.reason, route.predicted_cached_tokens) == (b, RoutingReason.NO_HIT, 0)

    # a overloaded beyond the threshold: the request goes elsewhere, predicted as a miss.
    a.load.num_waiting_tokens = 2000
    route = await router.route(PromptBlocks(PROMPT))
    assert (route.client, route.reason, route.predicted_cached_tokens) == (b, RoutingReason.LOAD_FALLBACK, 0)

    # Evicted blocks are no longer predicted.
    a.load.num_waiting_tokens = 0
    router.index.apply("a:1", [BlocksRemoved((hashes[1],))])
    assert (await router.route(PromptBlocks(PROMPT))).predicted_cached_tokens == 16


async def test_route_with_one_engine_or_least_load_hashes_nothing(monkeypatch):
    def no_hashing(*args, **kwargs):
        raise AssertionError("hashed a prompt with nothing to choose")

    monkeypatch.setattr(router_module, "hash_blocks", no_hashing)
    router = EngineRouter([], policy=RoutingPolicy.PREFIX)
    a = _client(router, "a:1")
    _client(router, "b:1", connected=False)
    route = await router.route(PromptBlocks(PROMPT))
    assert (route.client, route.reason, route.predicted_cached_tokens) == (a, RoutingReason.SINGLE_ENGINE, None)

    plain = EngineRouter([])
    assert plain.index is None
    _client(plain, "a:1", used_blocks=3)
    b = _client(plain, "b:1")
    route = await plain.route(PromptBlocks(PROMPT))
    assert (route.client, route.reason, route.predicted_cached_tokens) == (b, RoutingReason.LEAST_LOAD, None)


async def test_engines_hashing_otherwise_get_no_predictions():
    router = EngineRouter([], policy=RoutingPolicy.PREFIX)
    a = _client(router, "a:1", algorithm="md5-something")
    _client(router, "b:1", used_blocks=1)
    assert not a.predicts_prefix_hits  # so its session never subscribes: the index holds nothing of it
    route = await router.route(PromptBlocks(PROMPT))
    assert route.client is a and route.reason is RoutingReason.NO_HIT and route.predicted_cached_tokens is None


async def test_long_prompts_are_hashed_off_the_event_loop(monkeypatch):
    threads = []

    def spy(*args, **kwargs):
        threads.append(threading.get_ident())
        return hash_blocks(*args, **kwargs)

    monkeypatch.setattr(router_module, "hash_blocks", spy)
    prompt = PromptBlocks(list(range(router_module.HASH_OFF_LOOP_TOKENS + 17)))
    short = PromptBlocks(PROMPT)
    await prompt.hashes(16)
    await prompt.hashes(16)  # kept: hashed once per block size
    await short.hashes(16)
    assert len(threads) == 2
    assert threads[0] != threading.get_ident() and threads[1] == threading.get_ident()
    assert await prompt.hashes(16) == hash_blocks(prompt.token_ids, 16, len(prompt.token_ids) // 16)


async def test_an_engine_that_goes_away_is_dropped_from_the_index():
    router = EngineRouter([], policy=RoutingPolicy.PREFIX)
    client = EngineClient("a:1", index=router.index)
    hashes = hash_blocks(PROMPT, 16)
    event = engine_pb2.KvEvent(stored=engine_pb2.KvBlocksStored(block_hashes=hashes))
    client._on_response(engine_pb2.StreamResponse(kv_events=[event]))
    assert router.index.match(hashes) == {"a:1": 6}
    await client.close()
    assert router.index.match(hashes) == {} and router.index.engines == []


@pytest.mark.parametrize("first", [True, False])
def test_kv_events_convert_from_the_protocol(first):
    from frontend_svc.engine import convert

    h = [bytes([i]) * 32 for i in range(3)]
    events = convert.kv_events(
        [
            engine_pb2.KvEvent(snapshot=engine_pb2.KvSnapshot(first=first, last=True, block_hashes=h[:1])),
            engine_pb2.KvEvent(stored=engine_pb2.KvBlocksStored(parent_block_hash=h[0], block_hashes=h[1:])),
            engine_pb2.KvEvent(stored=engine_pb2.KvBlocksStored(block_hashes=h[:1])),
            engine_pb2.KvEvent(removed=engine_pb2.KvBlocksRemoved(block_hashes=h[2:])),
            engine_pb2.KvEvent(),  # a kind this frontend does not know: skipped
        ]
    )
    assert events == [
        CacheSnapshot((h[0],), first=first, last=True),
        BlocksStored((h[1], h[2]), h[0]),
        BlocksStored((h[0],), None),
        BlocksRemoved((h[2],)),
    ]
