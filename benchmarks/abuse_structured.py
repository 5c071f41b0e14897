"""Abusive structured-output requests against a running pair (scenarios of benchmarks.abuse).

    nested-schema      a 5.9 KB schema nested 984 levels, then a plain call: does the engine still answer?
    regex-bomb         (x{1000}){999} with n = 16, one after another (20/s at most): another stream's rate, worst gap
    bomb-memory        six distinct regex bombs: engine memory
    cancelled-compiles 100 distinct 59 KB schemas, each cancelled after 0.05 s, then a 60-byte schema

Only the public API is used, so the file measures an older checkout too.
"""

from __future__ import annotations

import asyncio
import json
import time

from benchmarks import abuse_kit as a
from tandem_protos.tandem.generate.v1 import generate_pb2 as g


def big_schema(tag: str, num_fields: int = 1000) -> str:
    props = {f"{tag}_{k}": {"type": "string", "maxLength": k % 50 + 1} for k in range(num_fields)}
    return json.dumps({"type": "object", "properties": props, "required": list(props)})


async def nested_schema(pair, stub) -> str:
    nested = '{"a":' * 984 + "1" + "}" * 984
    attack, _ = await a.outcome(stub.Generate(a.req("x", max_tokens=4, json_schema=nested), timeout=20))
    plain, seconds = await a.outcome(stub.Generate(a.req("plain", max_tokens=4), timeout=20))
    health = {1: "SERVING", 2: "NOT_SERVING"}.get(pair.engine.health(), "no answer")
    return f"attack {attack}; a plain call after it: {plain} in {seconds:.2f} s; engine health {health}"


async def regex_bomb(pair, stub) -> str:
    victim = a.Victim(stub)
    await asyncio.sleep(3)
    t0 = time.monotonic()
    codes: dict[str, int] = {}
    while time.monotonic() < t0 + 8:
        code, _ = await a.outcome(stub.Generate(a.req("x", max_tokens=8, n=16, regex="(x{1000}){999}"), timeout=20))
        codes[code] = codes.get(code, 0) + 1
        await asyncio.sleep(0.05)  # at most 20 a second: the server's cost, not this client's CPU
    t1 = time.monotonic()
    await victim.stop()
    return (
        f"victim {victim.rate(t0 - 3, t0):.0f} msg/s before, {victim.rate(t0, t1):.0f} msg/s during, worst gap "
        f"{victim.worst_gap(t0, t1) * 1e3:.0f} ms; attacks {codes}"
    )


async def bomb_memory(pair, stub) -> str:
    rss0, t0 = a.rss_mib(pair.engine.proc.pid), time.monotonic()
    codes: dict[str, int] = {}
    for i in range(6):
        bomb = f"(x{{1000}}){{{990 + i}}}"
        code, _ = await a.outcome(stub.Generate(a.req("x", max_tokens=4, regex=bomb), timeout=30))
        codes[code] = codes.get(code, 0) + 1
    rss1 = a.rss_mib(pair.engine.proc.pid)
    return f"engine RSS {rss0:.0f} -> {rss1:.0f} MiB after 6 distinct bombs in {time.monotonic() - t0:.1f} s; {codes}"


async def cancelled_compiles(pair, stub) -> str:
    rss0 = a.rss_mib(pair.engine.proc.pid)
    # 0.2 s apart, a compile (~0.3 s here) on each of two threads keeps up with them: 0.05 s
    # apart, their compiles queue up for ~15 s, past the 10 s limit.
    for i in range(100):
        call = stub.Generate(a.req("x", max_tokens=4, json_schema=big_schema(f"s{i}")))
        await asyncio.sleep(0.05)
        call.cancel()
    tiny = '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}'
    call = stub.Generate(g.GenerateRequest(text="hi", sampling_params=g.SamplingParams(max_tokens=8, json_schema=tiny)))
    code, seconds = await a.outcome(call)
    details = ""
    if code != "OK":
        details = f" ({(await call.details())[:90]})"
    rss1 = a.rss_mib(pair.engine.proc.pid)
    rss = f"engine RSS {rss0:.0f} -> {rss1:.0f} MiB"
    return f"the 60-byte schema after 100 cancelled: {code}{details} in {seconds:.2f} s; {rss}"


SCENARIOS = {
    "nested-schema": nested_schema,
    "regex-bomb": regex_bomb,
    "bomb-memory": bomb_memory,
    "cancelled-compiles": cancelled_compiles,
}
