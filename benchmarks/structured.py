"""Structured output's cost, for ``benchmarks.offline --constraint KIND:FILE``.

    throughput: the workload with every request constrained, then the same workload
        unconstrained with each request's max_tokens set to what its constrained run
        produced, so both runs generate exactly the same number of tokens
    first-token latency of one request on the idle engine: unconstrained, constrained with
        a schema never seen (the compile is on the path: cold), the same again (warm)

KIND is json_schema (FILE: a JSON Schema), regex, grammar (Lark) or choice (FILE: a JSON
list of strings). Requests are greedy with ignore_eos, as the rest of the offline
benchmark, so a constrained request runs until max_tokens or until its grammar allows
nothing but the end. Each run gets its own salt, so no run is served from blocks an
earlier run left in the prefix cache.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.workloads import salted

KINDS = ("json_schema", "regex", "grammar", "choice")


def parse_constraint(spec: str):
    """``KIND:FILE`` -> StructuredOutput."""
    from tandem_common.sampling import StructuredOutput, check_structured_output

    kind, _, path = spec.partition(":")
    if kind not in KINDS or not path:
        raise SystemExit(f"--constraint takes KIND:FILE with KIND one of {KINDS}, got {spec!r}")
    text = Path(path).read_text(encoding="utf-8")
    if kind == "choice":
        constraint = StructuredOutput("choice", choices=tuple(json.loads(text)))
    else:
        constraint = StructuredOutput(kind, text)
    if (error := check_structured_output(constraint)) is not None:
        raise SystemExit(f"{path}: {error.name}: {error.message}")
    return constraint


def run(core, workload: list[dict], constraint, *, repeats: int = 5) -> dict:
    """Figures for ``constraint`` on an idle, warmed-up EngineCore."""
    from engine_svc.types import FinishReason, SamplingParams

    vocab = core.vocab_size
    prompts = [r["prompt_token_ids"] for r in salted(workload, 1, vocab)]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in workload]
    core.generate([prompts[0]], replace(params[0], max_tokens=1, structured=constraint))  # compile outside the timing

    t0 = time.perf_counter()
    constrained = core.generate(prompts, [replace(p, structured=constraint) for p in params])
    constrained_s = time.perf_counter() - t0
    lengths = [len(c.output_token_ids) for c in constrained]
    errors = [c.error.message for c in constrained if c.error is not None]
    if errors:
        raise SystemExit(f"constrained requests failed: {errors[0]}")

    prompts = [r["prompt_token_ids"] for r in salted(workload, 2, vocab)]
    t0 = time.perf_counter()
    free = core.generate(prompts, [replace(p, max_tokens=n) for p, n in zip(params, lengths)])
    free_s = time.perf_counter() - t0
    assert [len(c.output_token_ids) for c in free] == lengths, "short unconstrained outputs"

    num_tokens = sum(lengths)
    out = {
        "kind": constraint.kind,
        "num_output_tokens": num_tokens,
        "num_ended_by_grammar": sum(c.finish_reason == FinishReason.STOP for c in constrained),
        "constrained_output_tok_per_s": num_tokens / constrained_s,
        "unconstrained_output_tok_per_s": num_tokens / free_s,
        "constrained_over_unconstrained": free_s / constrained_s,
    }
    return out | first_token_latency(core, workload[0]["prompt_token_ids"], constraint, repeats)


def first_token_latency(core, prompt: list[int], constraint, repeats: int) -> dict:
    """Median ms from add_request to the first token for one request on the idle engine.

    Cold: a variant of the constraint the engine has never compiled (a JSON schema gets a
    new "title"; other kinds, which have no such slot, are measured warm only); warm: the
    same constraint again, served from the cache.
    """
    from engine_svc.types import SamplingParams

    def ttft(structured, salt: int) -> float:
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, structured=structured)
        request = core.make_request(f"ttft-{salt}", [(prompt[0] + salt) % core.vocab_size, *prompt[1:]], params)
        start = time.perf_counter()
        core.add_request(request)
        while core.has_unfinished_requests():
            if not core.has_work():
                core.structured.wait(core.seconds_to_next_event())
            core.step()
        return (time.perf_counter() - start) * 1e3

    salt = 1000
    free, cold, warm, compile_ms = [], [], [], []
    for i in range(repeats):
        free.append(ttft(None, salt := salt + 1))
        variant = constraint
        if constraint.kind == "json_schema":
            schema = json.loads(constraint.text)
            variant = replace(constraint, text=json.dumps({**schema, "title": f"cold-{time.time_ns()}-{i}"}))
            cold.append(ttft(variant, salt := salt + 1))
            compile_ms.append(core.structured.stats().compile_durations_s[-1] * 1e3)
        warm.append(ttft(variant, salt := salt + 1))
    out = {
        "ttft_ms_unconstrained": statistics.median(free),
        "ttft_ms_warm_cache": statistics.median(warm),
        "ttft_ms_added_warm_cache": statistics.median(warm) - statistics.median(free),
    }
    if cold:
        out |= {
            "ttft_ms_cold_cache": statistics.median(cold),
            "ttft_ms_added_cold_cache": statistics.median(cold) - statistics.median(free),
            "compile_ms": statistics.median(compile_ms),
        }
    return out
