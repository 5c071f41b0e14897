"""What one grammar may cost the engine: compile limits, the first mask off the step
thread, failures remembered, the cache bounded by bytes, the queue bounded and dropped.

Real compiles on the demo model's tokenizer (``GrammarCompiler`` and ``LLGuidanceBackend``
as the engine runs them). Constraints here skip the shared up-front checks on purpose:
they are what a grammar that passes them, or an engine protocol client, can send.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from engine_svc.grammar_compiler import MAX_QUEUED_COMPILES_PER_STREAM, GrammarCompiler
from engine_svc.model.structured import GrammarMasks, LLGuidanceBackend
from engine_svc.model.structured.backend import fill_bitmasks
from engine_svc.sched.request import Request
from engine_svc.types import ErrorCode, RequestError, SamplingParams
from tandem_common.sampling import StructuredOutput

BOMB = StructuredOutput("regex", "(x{1000}){999}")  # 14 bytes, 999,000 copies of x unrolled


def big_schema(tag: str, num_fields: int = 700) -> StructuredOutput:
    """A legal schema (~40 KB at 700 fields) that takes a compile thread a few tenths of a second."""
    props = {f"{tag}_{k}": {"type": "string", "maxLength": k % 50 + 1} for k in range(num_fields)}
    return StructuredOutput("json_schema", json.dumps({"type": "object", "properties": props, "required": list(props)}))


@pytest.fixture(scope="module")
def setup(demo_model_dir):
    from engine_svc.model.load.loader import read_special_token_ids

    _, eos = read_special_token_ids(demo_model_dir)
    return LLGuidanceBackend.from_model_dir(demo_model_dir, 2048, eos), eos


def _request(constraint: StructuredOutput, eos, request_id: str = "0/1") -> Request:
    """A request of stream <s> for id "<s>/<n>", as the engine loop names and tags them."""
    stream_id = int(request_id.partition("/")[0])
    return Request(request_id, [1, 2, 3], SamplingParams(structured=constraint), eos_token_ids=eos, stream_id=stream_id)


def _settle(compiler: GrammarCompiler, n: int, timeout: float = 60.0) -> list:
    out: list = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        compiler.wait(0.05)
        out += compiler.ready()
    assert len(out) == n, f"{len(out)} of {n} compiles settled in {timeout} s"
    return out


def test_a_regex_bomb_compiles_within_the_limits(setup):
    backend, _ = setup
    start = time.perf_counter()
    grammar = backend.compile(BOMB)
    seconds = time.perf_counter() - start
    # llguidance's defaults: ~170 MiB of heap and ~0.8 s on an idle core.
    assert grammar.num_bytes < 80 << 20, grammar.num_bytes / 2**20
    assert seconds < 5, seconds


def test_the_first_mask_is_computed_at_compile_time_not_per_request(setup):
    backend, eos = setup
    grammar = backend.compile(BOMB)
    copy = grammar.matcher()
    row = grammar.first_mask.copy()
    start = time.perf_counter()
    fill_bitmasks([(copy, 0)], row[None, :])
    one_fill = time.perf_counter() - start
    assert (row == grammar.first_mask).all()

    requests = [_request(BOMB, eos, f"0/{i}") for i in range(16)]
    for r in requests:
        r.grammar = grammar
    masks = GrammarMasks(2048, torch.device("cpu"))
    start = time.perf_counter()
    batch = masks.batch_mask(requests)
    assert batch is not None and not batch.errors
    # Each fresh copy would redo that fill on the step thread (16 x ~0.09 s for this regex).
    assert time.perf_counter() - start < max(4 * one_fill, 0.05)


def test_a_grammar_that_fails_at_run_time_fails_its_next_requests_at_once(setup):
    backend, eos = setup
    compiler = GrammarCompiler(backend, timeout_s=60)
    first = _request(BOMB, eos, "0/1")
    assert compiler.submit(first) is None
    [(request, grammar)] = _settle(compiler, 1)
    request.grammar = grammar
    request.append_output_token(backend.tokenizer.tokenize_str("x")[0])
    batch = GrammarMasks(2048, torch.device("cpu")).batch_mask([request])
    assert batch is not None and "too many expressions" in batch.errors["0/1"].message

    start = time.perf_counter()
    again = compiler.submit(_request(BOMB, eos, "0/2"))
    assert time.perf_counter() - start < 0.01
    assert isinstance(again, RequestError) and again.code == ErrorCode.INVALID_ARGUMENT
    assert "failed an earlier request" in again.message and "too many expressions" in again.message


def test_the_cache_is_bounded_by_bytes(setup):
    backend, eos = setup
    compiler = GrammarCompiler(backend, timeout_s=60, cache_bytes=3 << 20)  # ~1-2 of these schemas
    schemas = [big_schema(f"c{i}") for i in range(4)]
    for i, schema in enumerate(schemas):
        assert compiler.submit(_request(schema, eos, f"0/{i}")) is None
        _settle(compiler, 1)
    assert 0 < compiler.cache_bytes <= 3 << 20
    assert compiler.submit(_request(schemas[-1], eos, "0/9")) is not None  # the newest is cached
    assert compiler.submit(_request(schemas[0], eos, "0/10")) is None  # the oldest was evicted


def test_an_aborted_compile_is_dropped_before_it_starts(setup):
    backend, eos = setup
    compiler = GrammarCompiler(backend, timeout_s=60)
    ids = [f"0/{i}" for i in range(MAX_QUEUED_COMPILES_PER_STREAM)]
    for i, request_id in enumerate(ids):
        assert compiler.submit(_request(big_schema(f"a{i}"), eos, request_id)) is None
    assert len(compiler.abort(ids)) == len(ids)
    start = time.monotonic()
    assert compiler.submit(_request(StructuredOutput("regex", "[a-z]{3}"), eos, "0/99")) is None
    [(_, grammar)] = _settle(compiler, 1)
    assert not isinstance(grammar, RequestError)
    # At most the two compiles already running were waited for, not the whole queue.
    durations = compiler.stats().compile_durations_s  # compiles finished so far
    assert 1 <= len(durations) <= 3, durations
    assert time.monotonic() - start < 30


def test_the_queue_is_bounded_per_stream_and_refusals_are_retryable(setup):
    backend, eos = setup
    compiler = GrammarCompiler(backend, timeout_s=60)
    n = MAX_QUEUED_COMPILES_PER_STREAM + 4
    # The schemas built first: built between submits, a loaded machine gave the threads time
    # to finish a compile and take a third request off the queue.
    requests = [_request(big_schema(f"q{i}"), eos, f"0/{i}") for i in range(n)]
    outcomes = [compiler.submit(r) for r in requests]
    refused = [o for o in outcomes if o is not None]
    assert 2 <= len(refused) <= 4  # 8 queued, up to 2 already taken by the threads
    assert all(isinstance(o, RequestError) and o.code == ErrorCode.RESOURCE_EXHAUSTED for o in refused)
    assert "retry" in refused[0].message and str(MAX_QUEUED_COMPILES_PER_STREAM) in refused[0].message
    # Another stream still has its share.
    assert compiler.submit(_request(big_schema("other"), eos, "1/1")) is None
    compiler.abort([f"0/{i}" for i in range(n)] + ["1/1"])
    compiler.shutdown()


def test_a_compile_that_waited_for_a_thread_past_the_timeout_is_retryable(setup):
    backend, eos = setup
    # Each big schema takes a thread ~25 ms or more (more on a loaded machine); the small
    # one waits behind four of them on two threads, past a 20 ms limit whatever the speed.
    compiler = GrammarCompiler(backend, timeout_s=0.02)
    for i in range(4):  # two running, two queued ahead
        compiler.submit(_request(big_schema(f"t{i}", 1000), eos, f"0/{i}"))
    compiler.submit(_request(StructuredOutput("regex", "[0-9]+"), eos, "0/small"))
    outcomes = {r.request_id: o for r, o in _settle(compiler, 5)}
    small = outcomes["0/small"]
    assert isinstance(small, RequestError) and small.code == ErrorCode.RESOURCE_EXHAUSTED, small
    assert "compile threads were busy" in small.message and "retry" in small.message
    compiler.shutdown()
