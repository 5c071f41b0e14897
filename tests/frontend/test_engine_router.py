"""EngineRouter: target parsing, least-load and prefix-aware choice, DNS discovery and retirement."""

from __future__ import annotations

import asyncio

import pytest

from frontend_svc.engine.client import EngineClient
from frontend_svc.engine.handle import RequestHandle
from frontend_svc.engine.router import EngineRouter, parse_dns_target
from frontend_svc.types import EngineLoad, EngineOutput, EngineUnavailableError, ModelInfo
from tandem_common.block_hash import BLOCK_HASH_ALGORITHM
from tandem_common.sampling import SamplingParams
from tandem_common.types import FinishReason
from tandem_protos.tandem.engine.v1 import engine_pb2


def test_parse_dns_target():
    assert parse_dns_target("dns:///engines.default.svc.cluster.local:50051") == (
        "engines.default.svc.cluster.local",
        50051,
    )
    assert parse_dns_target("dns://8.8.8.8/engines:7") == ("engines", 7)
    assert parse_dns_target("dns:///[::1]:9") == ("::1", 9)
    with pytest.raises(ValueError):
        parse_dns_target("dns:///no-port")


def _client(
    router: EngineRouter,
    address: str,
    *,
    used_blocks=0,
    waiting_tokens=0,
    connected=True,
    draining=False,
    block_size=16,
    algorithm=BLOCK_HASH_ALGORITHM,
) -> EngineClient:
    client = EngineClient(address, index=router.index)  # never started: its figures are set by hand
    client.connected = connected
    client.model_info = ModelInfo("m", 2048, 2048, block_size=block_size, block_hash_algorithm=algorithm)
    client.load = EngineLoad(num_used_blocks=used_blocks, num_waiting_tokens=waiting_tokens, draining=draining)
    router._clients[address] = client
    return client


def _send(client: EngineClient, request_id: str, num_tokens: int) -> None:
    """A request sent by this frontend (the stream is faked: no engine behind it)."""
    client._outbox, client.connected = asyncio.Queue(), True
    client.add(request_id, [1] * num_tokens, SamplingParams())


def test_pick_takes_the_least_queued_and_running_tokens_among_available_engines():
    router = EngineRouter([])
    a = _client(router, "a:1", used_blocks=6, waiting_tokens=32)  # 6 x 16 + 32 = 128 tokens
    b = _client(router, "b:1", used_blocks=1, waiting_tokens=40)  # 56 tokens
    _client(router, "c:1", connected=False)
    _client(router, "d:1", draining=True)
    assert (a.load_tokens, b.load_tokens) == (128, 56)
    assert router.pick() is b
    assert router.healthy and router.num_connected == 3
    # Our own requests count at once, by their prompt tokens, until their first output.
    _send(b, "x", 100)
    assert b.load_tokens == 156 and router.pick() is a
    b._on_response(engine_pb2.StreamResponse(outputs=[engine_pb2.RequestOutput(request_id="x", new_token_ids=[5])]))
    assert b.load_tokens == 56 and router.pick() is b


def test_pick_without_available_engine_is_unavailable():
    router = EngineRouter([])
    _client(router, "a:1", connected=False)
    with pytest.raises(EngineUnavailableError, match="no engine is available"):
        router.pick()
    assert not router.healthy


async def test_handle_merges_unread_outputs_and_iterates_to_the_end():
    handle = RequestHandle("r")
    handle.deliver(EngineOutput("r", [1, 2], num_cached_tokens=2))
    handle.deliver(EngineOutput("r", [3]))
    handle.deliver(EngineOutput("r", [4], finish_reason=FinishReason.LENGTH))
    got = [out async for out in handle]
    assert len(got) == 1
    assert got[0].new_token_ids == [1, 2, 3, 4] and got[0].finish_reason is FinishReason.LENGTH
    assert got[0].num_cached_tokens == 2


def test_handle_asks_its_deliverer_to_wake_the_reader_and_never_wakes_it_itself():
    handle = RequestHandle("r", stream_interval=3)
    assert handle.deliver(EngineOutput("r", [1]))  # the first output
    assert not handle.deliver(EngineOutput("r", [2]))  # 2 tokens pending, fewer than the interval
    assert handle.deliver(EngineOutput("r", [3]))  # 3 pending
    assert handle.take().new_token_ids == [1, 2, 3]
    assert not handle.deliver(EngineOutput("r", [4]))
    assert handle.deliver(EngineOutput("r", [], finish_reason=FinishReason.LENGTH))  # the end
    assert not handle.wakeup.is_set() and handle.finished
    aborted = RequestHandle("s")
    aborted.aborted = True
    assert not aborted.deliver(EngineOutput("s", [1], finish_reason=FinishReason.ABORT))
    assert aborted.finished and aborted.take() is None


async def test_handle_failure_is_raised_after_pending_outputs():
    handle = RequestHandle("r")
    handle.deliver(EngineOutput("r", [1]))
    handle.fail(EngineUnavailableError("engine a:1 went away: boom"))
    assert handle.take().new_token_ids == [1]
    with pytest.raises(EngineUnavailableError, match="went away"):
        handle.take()


async def test_dns_discovery_adds_and_retires_engines():
    # "localhost" resolves without a network; the ports are closed, so clients stay unconnected.
    router = EngineRouter(["dns:///localhost:1"], dns_refresh_s=3600)
    await router.start()
    try:
        addresses = {c.address for c in router.clients}
        assert "127.0.0.1:1" in addresses
        client = router._clients["127.0.0.1:1"]
        client._task.cancel()  # keep its reconnect loop from failing the request added below
        # The name now resolves elsewhere: the old engine retires once its request ends.
        router._dns = [("localhost", 2)]
        client._requests["busy"] = RequestHandle("busy")
        await router.refresh()
        assert "127.0.0.1:2" in {c.address for c in router.clients}
        assert client.retiring and "127.0.0.1:1" in router._clients
        del client._requests["busy"]
        for _ in range(50):
            if "127.0.0.1:1" not in router._clients:
                break
            await asyncio.sleep(0.05)
        assert "127.0.0.1:1" not in router._clients
    finally:
        await router.close()
