"""tandem_common.block_hash: the one hash definition both services compute."""

from __future__ import annotations

import hashlib
import struct

from tandem_common.block_hash import hash_block, hash_blocks, max_hit_blocks, salted


def test_hash_is_sha256_over_parent_and_little_endian_int64_ids():
    # The definition other implementations must follow, written out by hand.
    first = hashlib.sha256(struct.pack("<4q", 1, 2, 3, 4)).digest()
    assert hash_block(None, [1, 2, 3, 4]) == first
    assert hash_block(first, [5, 6, 7, 8]) == hashlib.sha256(first + struct.pack("<4q", 5, 6, 7, 8)).digest()


def test_hash_is_chained_over_the_parent():
    first = hash_block(None, [1, 2, 3, 4])
    assert hash_block(first, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert hash_block(first, [5, 6, 7, 8]) == hash_block(hash_block(None, [1, 2, 3, 4]), [5, 6, 7, 8])


def test_hash_blocks_equals_block_by_block_and_skips_the_partial_tail():
    tokens = list(range(100, 111))  # two full blocks of 4 and 3 tokens left over
    h0 = hash_block(None, tokens[:4])
    h1 = hash_block(h0, tokens[4:8])
    assert hash_blocks(tokens, 4) == [h0, h1]
    assert hash_blocks(tokens, 4, num_blocks=1) == [h0]
    assert hash_blocks(tokens, 4, num_blocks=9) == [h0, h1]
    assert hash_blocks(tokens[4:8], 4, parent_hash=h0) == [h1]
    assert hash_blocks(tokens[:3], 4) == [] and hash_blocks(tokens, 4, num_blocks=0) == []


def test_max_hit_blocks_leaves_the_last_token_and_skips_prompt_logprobs():
    assert max_hit_blocks(8, 4) == 1  # exactly two blocks: the last token must be computed
    assert max_hit_blocks(9, 4) == 2
    assert max_hit_blocks(3, 4) == 0 and max_hit_blocks(0, 4) == 0
    assert max_hit_blocks(9, 4, prompt_logprobs=True) == 0


def test_a_cache_salt_gives_each_salt_and_adapter_a_chain_of_its_own():
    tokens = list(range(100, 112))
    digest = b"\x01" * 32
    parents = [salted(None, None), salted(None, "alice"), salted(None, "bob"), salted(digest, "alice"), digest]
    assert parents[0] is None and salted(digest, None) == digest and salted(None, "") is None
    chains = [hash_blocks(tokens, 4, parent_hash=p) for p in parents]
    assert len({h for chain in chains for h in chain}) == 3 * len(parents)  # no block shared
    assert salted(None, "alice") == salted(None, "alice")  # both services compute the same


def test_the_routers_prediction_and_the_engines_request_hash_the_same_salted_chain():
    import asyncio

    from engine_svc.sched.request import Request
    from engine_svc.types import SamplingParams
    from frontend_svc.engine.router import PromptBlocks

    tokens = list(range(100, 112))
    request = Request("r", tokens, SamplingParams(), cache_salt="alice")
    predicted = asyncio.run(PromptBlocks(tokens, cache_salt="alice").hashes(4))
    assert predicted == hash_blocks(tokens, 4, num_blocks=2, parent_hash=request.cache_salt)
    assert predicted != hash_blocks(tokens, 4, num_blocks=2)
