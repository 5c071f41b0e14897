"""Prefix-aware routing end to end: two real engines behind one frontend on the demo model.

The frontend runs ``--routing prefix --routing-load-threshold 400`` with JSON logs (each
Generate call's line names its engine, the routing reason and the predicted cached
tokens) and metrics (per-engine load and index size, read to wait on the frontend's view
of the engines instead of sleeping). Every prompt is fresh random ids, so tests do not
see each other's blocks; block size 16.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.reliability.faults import free_port
from tests.rpc.engine_stream import EngineStream
from tests.rpc.frontend_calls import generate, stub_of
from tests.services import ServiceProcess, start_engine, start_frontend

THRESHOLD = 400
GREEDY = dict(max_tokens=2, temperature=0.0, ignore_eos=True)
_rng = random.Random(17)


def _prompt(n: int) -> list[int]:
    return [_rng.randrange(3, 2000) for _ in range(n)]


class Cluster:
    """Two engines and a frontend; ``engines`` is updated when a test restarts one."""

    def __init__(self, model_dir) -> None:
        self.model_dir = model_dir
        self.engines: list[ServiceProcess] = []
        self.frontends: list[ServiceProcess] = []
        self.metrics_ports: list[int] = []

    def start_frontend(self) -> ServiceProcess:
        port = free_port()
        extra = ("--routing", "prefix", "--routing-load-threshold", str(THRESHOLD), "--log-format", "json")
        proc = start_frontend(*(e.address for e in self.engines), extra=(*extra, "--metrics-port", str(port)))
        self.frontends.append(proc)
        self.metrics_ports.append(port)
        return proc.wait_serving()

    def metrics(self, i: int = 0) -> dict[tuple[str, tuple], float]:
        url = f"http://127.0.0.1:{self.metrics_ports[i]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as page:
            text = page.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def engine_figure(self, name: str, engine: str, i: int = 0) -> float | None:
        return self.metrics(i).get((name, (("engine", engine),)))

    async def wait_for(self, predicate, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not await asyncio.to_thread(predicate):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}:\n{self.frontends[0].log()[-3000:]}")
            await asyncio.sleep(0.05)

    async def call(self, request_id: str, prompt: list[int], i: int = 0, **params) -> tuple[dict, int]:
        """One Generate call: (its JSON log line, the usage's cached tokens)."""
        async with grpc.aio.insecure_channel(self.frontends[i].address) as channel:
            responses = await generate(
                stub_of(channel), token_ids=prompt, request_id=request_id, params={**GREEDY, **params}
            )
        cached = responses[-1].usage.cached_tokens
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the line follows the call's end by a moment
            for line in self.frontends[i].log().splitlines():
                if f'"request_id": "{request_id}"' in line and '"message": "Generate' in line:
                    return json.loads(line), cached
            await asyncio.sleep(0.02)
        raise AssertionError(f"no log line for {request_id}")


@pytest.fixture(scope="module")
def cluster(demo_model_dir):
    c = Cluster(demo_model_dir)
    try:
        c.engines = [start_engine(demo_model_dir, "--num-kv-blocks", "256") for _ in range(2)]
        for e in c.engines:
            e.wait_serving()
        c.start_frontend()
        yield c
    finally:
        for proc in (*c.frontends, *c.engines):
            proc.terminate()


def _other(cluster: Cluster, address: str) -> str:
    return next(e.address for e in cluster.engines if e.address != address)


async def test_a_request_sharing_a_warm_prefix_goes_to_the_engine_holding_it(cluster):
    for n in range(2):
        a = _prompt(64)
        line_a, _ = await cluster.call(f"warm-{n}", a)
        x = line_a["engine"]
        assert line_a["routing"] in ("no_hit", "prefix_hit") and line_a["predicted_cached_tokens"] == 0
        # x busier than the other engine, within the threshold: least load would pick the other.
        async with grpc.aio.insecure_channel(x) as channel:
            busy = EngineStream(channel)
            try:
                busy.add("busy", _prompt(100), max_tokens=1500, temperature=0.0, ignore_eos=True)
                await cluster.wait_for(
                    lambda x=x: (cluster.engine_figure("tandem_frontend_engine_load_tokens", x) or 0) >= 100,
                    "the frontend to see x's load",
                )
                b = a[:48] + _prompt(20)  # three blocks in common
                line_b, cached = await cluster.call(f"share-{n}", b)
            finally:
                busy.cancel()
        assert line_b["engine"] == x and line_b["routing"] == "prefix_hit"
        assert line_b["predicted_cached_tokens"] == 48 and cached == 48
    metrics = cluster.metrics()
    assert metrics[("tandem_frontend_routing_decisions_total", (("reason", "prefix_hit"),))] >= 2
    assert metrics[("tandem_frontend_prefix_predictions_total", (("outcome", "exact"),))] >= 4
    assert metrics[("tandem_frontend_predicted_cached_tokens_total", ())] >= 96
    assert metrics[("tandem_frontend_predicted_calls_cached_tokens_total", ())] >= 96


async def test_an_overloaded_engine_holding_the_prefix_is_passed_over(cluster):
    a = _prompt(64)
    x = (await cluster.call("hot-warm", a))[0]["engine"]
    y = _other(cluster, x)
    async with grpc.aio.insecure_channel(x) as channel:
        busy = EngineStream(channel)
        try:
            for i in range(3):  # 3 x 200 tokens: about 600 tokens of load, 400 more than y's
                busy.add(f"busy-{i}", _prompt(200), max_tokens=1500, temperature=0.0, ignore_eos=True)

            def overloaded() -> bool:
                load = lambda e: cluster.engine_figure("tandem_frontend_engine_load_tokens", e) or 0  # noqa: E731
                return load(x) > load(y) + THRESHOLD

            await cluster.wait_for(overloaded, "x's load to pass the threshold")
            line, cached = await cluster.call("hot-share", a[:48] + _prompt(20))
        finally:
            busy.cancel()
    assert line["engine"] == y and line["routing"] == "load_fallback"
    assert line["predicted_cached_tokens"] == 0 and cached == 0


async def test_a_new_frontend_learns_the_engines_caches_from_their_snapshots(cluster):
    a = _prompt(64)
    x = (await cluster.call("snap-warm", a))[0]["engine"]
    cluster.start_frontend()
    line, cached = await cluster.call("snap-share", a[:48] + _prompt(20), i=1)
    assert line["engine"] == x and line["routing"] == "prefix_hit"
    assert line["predicted_cached_tokens"] == 48 and cached == 48


async def test_after_an_engine_restarts_its_old_blocks_are_no_longer_predicted(cluster):
    a = _prompt(64)
    x = (await cluster.call("restart-warm", a))[0]["engine"]
    blocks = "tandem_frontend_prefix_index_blocks"
    assert (cluster.engine_figure(blocks, x) or 0) >= 4
    (old,) = [e for e in cluster.engines if e.address == x]
    port = old.port
    old.terminate()
    # Dropped from the index as soon as its stream ends, not when it comes back.
    await cluster.wait_for(lambda: cluster.engine_figure(blocks, x) is None, "x to leave the index")
    new = start_engine(cluster.model_dir, "--num-kv-blocks", "256", port=port)
    cluster.engines[cluster.engines.index(old)] = new
    new.wait_serving()
    await cluster.wait_for(lambda: cluster.engine_figure(blocks, x) is not None, "x's new snapshot")

    line, cached = await cluster.call("restart-share", a[:48] + _prompt(20))
    assert line["routing"] == "no_hit" and line["predicted_cached_tokens"] == 0 and cached == 0
    # Events flow again on the new stream: a prompt warmed now is predicted where it went.
    c = _prompt(64)
    z = (await cluster.call("restart-warm-again", c))[0]["engine"]
    line, cached = await cluster.call("restart-share-again", c[:32] + _prompt(20))
    assert line["engine"] == z and line["predicted_cached_tokens"] == 32 and cached == 32
