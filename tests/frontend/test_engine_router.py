"""EngineRouter: target parsing, least-outstanding-work choice, DNS discovery and retirement."""

from __future__ import annotations

import asyncio

import pytest

from frontend_svc.engine.client import EngineClient
from frontend_svc.engine.handle import RequestHandle
from frontend_svc.engine.router import EngineRouter, parse_dns_target
from frontend_svc.engine.types import EngineLoad, EngineOutput, EngineUnavailableError
from tandem_common.types import FinishReason


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
    router: EngineRouter, address: str, *, running=0, waiting=0, outstanding=0, connected=True, draining=False
) -> EngineClient:
    client = EngineClient(address)  # never started: its figures are set by hand
    client.connected = connected
    client.load = EngineLoad(num_running=running, num_waiting=waiting, draining=draining)
    for i in range(outstanding):
        client._requests[f"{address}-{i}"] = RequestHandle(f"{address}-{i}", client, None)
    router._clients[address] = client
    return client


def test_pick_takes_least_outstanding_work_among_available_engines():
    router = EngineRouter([])
    _client(router, "a:1", running=4, waiting=2)
    b = _client(router, "b:1", running=1, outstanding=2)
    _client(router, "c:1", connected=False)
    _client(router, "d:1", draining=True)
    assert router.pick() is b
    assert router.healthy and router.num_connected == 3
    # Our own in-flight requests count at once, before the engine reports them.
    for i in range(4):
        b._requests[f"x{i}"] = RequestHandle(f"x{i}", b, None)
    assert router.pick().address == "a:1"


def test_pick_without_available_engine_is_unavailable():
    router = EngineRouter([])
    _client(router, "a:1", connected=False)
    with pytest.raises(EngineUnavailableError, match="no engine is available"):
        router.pick()
    assert not router.healthy


async def test_handle_merges_unread_outputs_and_iterates_to_the_end():
    handle = RequestHandle("r", EngineClient("a:1"), None)
    handle.deliver(EngineOutput("r", [1, 2], num_cached_tokens=2))
    handle.deliver(EngineOutput("r", [3]))
    handle.deliver(EngineOutput("r", [4], finish_reason=FinishReason.LENGTH))
    got = [out async for out in handle]
    assert len(got) == 1
    assert got[0].new_token_ids == [1, 2, 3, 4] and got[0].finish_reason is FinishReason.LENGTH
    assert got[0].num_cached_tokens == 2


async def test_handle_failure_is_raised_after_pending_outputs():
    handle = RequestHandle("r", EngineClient("a:1"), None)
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
        client._requests["busy"] = RequestHandle("busy", client, None)
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
