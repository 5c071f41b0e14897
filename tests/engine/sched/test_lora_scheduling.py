"""The scheduler's LoRA rule (sched/lora.py) and the adapter-salted prefix cache, without a model.

At most --max-loras distinct adapters run at once: a waiting request whose adapter would be
one too many is passed over and keeps its place, base requests and requests of adapters
already running go ahead of it, and it runs as soon as an adapter's requests finish. Blocks
cached under one adapter's digest are never hits for another, nor for the base model.
"""

from __future__ import annotations

from engine_svc.sched.kv_cache import KVCacheManager
from engine_svc.sched.lora import LoraStepLimit
from engine_svc.sched.scheduler import Scheduler
from tandem_common.block_hash import hash_blocks
from tests.engine.sched.test_scheduler import BS, make_request, step


def _scheduler(max_loras: int) -> Scheduler:
    kv = KVCacheManager(64, BS)
    return Scheduler(
        kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024, lora_limit=LoraStepLimit(max_loras)
    )


def _adapter_request(request_id: str, adapter: str | None, prompt=4, **kw):
    request = make_request(request_id, prompt, **kw)
    request.lora_name = adapter
    return request


def test_a_third_adapter_waits_in_place_while_base_and_running_adapters_go_ahead():
    s = _scheduler(max_loras=2)
    s.add_request(_adapter_request("a1", "a", max_tokens=3))
    s.add_request(_adapter_request("b1", "b", max_tokens=6))
    s.add_request(_adapter_request("c1", "c", max_tokens=2))  # one adapter too many
    s.add_request(_adapter_request("base", None, max_tokens=2))
    s.add_request(_adapter_request("a2", "a", max_tokens=2))
    first = step(s)
    assert [r[0] for r in first.rows] == ["a1", "b1", "base", "a2"]
    assert [r.request_id for r in s.waiting] == ["c1"]
    seen_together = set()
    while s.has_unfinished_requests():
        st = step(s)
        names = {s_.request.lora_name for s_ in st.scheduler_output.scheduled} - {None}
        assert len(names) <= 2, names
        seen_together |= {frozenset(names)}
    assert any("c" in names for names in seen_together)  # it ran once "a" had finished


def test_every_request_finishes_under_max_loras_1():
    s = _scheduler(max_loras=1)
    for i, adapter in enumerate("abcabc"):
        s.add_request(_adapter_request(f"r{i}", adapter, max_tokens=3))
    done = set()
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        st = step(s)
        assert len({s_.request.lora_name for s_ in st.scheduler_output.scheduled}) <= 1
        done |= {rid for rid, o in st.outputs.items() if o.finished}
    assert done == {f"r{i}" for i in range(6)}


def test_blocks_cached_under_one_adapter_are_hits_for_it_alone():
    kv = KVCacheManager(64, BS)
    prompt = list(range(100, 113))  # 3 full blocks and a partial one
    digests = {"a": bytes(32), "b": b"\x01" * 32}

    def hits(request_id: str, adapter: str | None) -> int:
        request = _adapter_request(request_id, adapter, prompt)
        request.cache_salt = digests.get(adapter)
        blocks, num_hit = kv.get_computed_blocks(request)
        kv.allocate_slots(request, len(prompt) - num_hit, blocks)
        request.num_computed_tokens = len(prompt)
        kv.cache_full_blocks(request)
        kv.free(request)
        return num_hit

    assert hits("a-first", "a") == 0
    assert hits("a-again", "a") == 12
    assert hits("b", "b") == 0
    assert hits("base", None) == 0
    assert hits("base-again", None) == 12
    # The frontend predicts with the same salted chain the engine caches by.
    salted = hash_blocks(prompt, BS, parent_hash=digests["a"])
    assert salted != hash_blocks(prompt, BS) and set(salted) <= set(kv.cached_hashes())
