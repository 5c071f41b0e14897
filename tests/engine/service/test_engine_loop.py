"""EngineLoop.start(build): the model is built, warmed up and stepped on one thread."""

from __future__ import annotations

import threading

import pytest

from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.service.engine_loop import AddCommand, EngineLoop
from engine_svc.types import SamplingParams


def test_build_runs_on_the_thread_that_steps(demo_model_dir):
    threads: dict[str, set[int]] = {"build": set(), "step": set()}

    def build() -> EngineCore:
        threads["build"].add(threading.get_ident())
        core = EngineCore(EngineConfig(model=str(demo_model_dir), num_kv_blocks=16, block_size=16))
        core.warmup()
        return core

    loop = EngineLoop()
    loop.start(build)
    try:
        assert loop.core is not None
        loop.on_stats = lambda stats, outputs: threads["step"].add(threading.get_ident())
        done, tokens = threading.Event(), []

        def sink(outs, load):
            if outs is None:
                done.set()
            else:
                tokens.extend(t for o in outs for t in o.new_token_ids)

        sid = loop.open_stream(sink)
        loop.add(sid, AddCommand("a", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)))
        loop.half_close(sid)
        assert done.wait(60), "the request did not finish"
    finally:
        loop.stop()
    assert len(tokens) == 5
    assert len(threads["build"]) == 1 and threads["step"] == threads["build"]
    assert threading.get_ident() not in threads["build"]


def test_a_failing_build_raises_from_start_and_leaves_no_thread():
    def build() -> EngineCore:
        raise FileNotFoundError("no config.json in /nowhere")

    loop = EngineLoop()
    with pytest.raises(FileNotFoundError, match="/nowhere"):
        loop.start(build)
    loop._thread.join(timeout=5)
    assert not loop._thread.is_alive() and loop.core is None


def test_start_needs_a_core_or_a_build_function():
    with pytest.raises(ValueError, match="a core to the constructor or a build function"):
        EngineLoop().start()


def test_a_finished_compile_wakes_the_sleeping_loop(demo_model_dir):
    """The only request waits for its grammar: the loop sleeps until the compile thread
    wakes it, not until the (here ten-minute) compile deadline."""
    from tandem_common.sampling import StructuredOutput

    config = EngineConfig(model=str(demo_model_dir), num_kv_blocks=16, structured_output_timeout_s=600)
    loop = EngineLoop(EngineCore(config))
    loop.start()
    try:
        done, outputs = threading.Event(), []

        def sink(outs, load):
            if outs is None:
                done.set()
            else:
                outputs.extend(outs)

        sid = loop.open_stream(sink)
        params = SamplingParams(max_tokens=8, temperature=0.0, structured=StructuredOutput("regex", "[a-z]{3}-woken"))
        loop.add(sid, AddCommand("a", [1, 2, 3], params))
        loop.half_close(sid)
        assert done.wait(120), "the loop slept through the compile"
    finally:
        loop.stop()
    assert outputs[-1].finished and outputs[-1].error is None


def test_cache_events_are_recorded_only_while_a_stream_subscribes(demo_model_dir):
    import time

    from tandem_common.block_hash import hash_blocks
    from tandem_common.kv_events import BlocksStored, CacheSnapshot

    core = EngineCore(EngineConfig(model=str(demo_model_dir), num_kv_blocks=32, block_size=16))
    loop = EngineLoop(core)
    loop.start()
    try:
        batches, done = [], threading.Event()

        def sink(outs, load):
            if outs and any(o.finished for o in outs):
                done.set()

        quiet = loop.open_stream(sink)
        loop.add(quiet, AddCommand("a", list(range(3, 40)), SamplingParams(max_tokens=1)))
        assert done.wait(60)
        assert core.kv_cache.events is None  # a stream that did not subscribe costs nothing

        listener = loop.open_stream(lambda outs, load: None)
        got = threading.Event()
        loop.subscribe_kv_events(listener, lambda events, stats: (batches.append(events), got.set()), 100)
        assert got.wait(10)
        (snapshot,) = batches[0]
        assert isinstance(snapshot, CacheSnapshot) and snapshot.first and snapshot.last
        assert set(hash_blocks(list(range(3, 40)), 16)) <= set(snapshot.block_hashes)

        done.clear()
        loop.add(quiet, AddCommand("b", list(range(50, 90)), SamplingParams(max_tokens=1)))
        assert done.wait(60)
        stored = [e for b in batches[1:] for e in b if isinstance(e, BlocksStored)]
        assert [h for e in stored for h in e.block_hashes] == hash_blocks(list(range(50, 90)), 16)

        loop.close_stream(listener)  # the last subscriber leaves: recording stops
        deadline = time.monotonic() + 10
        while core.kv_cache.events is not None:
            assert time.monotonic() < deadline, "still recording after the subscriber left"
            time.sleep(0.01)
    finally:
        loop.stop()
