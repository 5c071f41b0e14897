"""One client cannot take every call slot: each API key (or address) gets a bounded share."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from frontend_svc.service.fair_share import client_of, peer_host
from tests.reliability.faults import request
from tests.rpc.frontend_calls import stub_of
from tests.services import start_frontend


def key(k: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {k}"),)


async def test_a_client_past_its_share_is_refused_and_others_still_get_in(engine_proc, procs):
    extra = ("--api-key", "key-a", "--api-key", "key-b", "--max-concurrent-calls", "8", "--max-calls-per-client", "3")
    frontend = procs(start_frontend(engine_proc.address, extra=extra)).wait_serving()
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        stub = stub_of(channel)
        held = [stub.Generate(request(f"held {i}", max_tokens=1500), metadata=key("key-a")) for i in range(3)]
        try:
            await asyncio.wait_for(asyncio.gather(*(c.read() for c in held)), 60)  # all three in progress
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Generate(request("one more", max_tokens=2), metadata=key("key-a")).read()
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-calls-per-client 3" in e.value.details()
            # Another key has its own share, free slots are still there for it.
            other = [r async for r in stub.Generate(request("other", max_tokens=2), metadata=key("key-b"))]
            assert other[-1].usage.completion_tokens == 2
            # A slot given back is the client's again.
            held.pop().cancel()
            await asyncio.sleep(0.5)
            again = [r async for r in stub.Generate(request("again", max_tokens=2), metadata=key("key-a"))]
            assert again[-1].usage.completion_tokens == 2
        finally:
            for c in held:
                c.cancel()


def test_clients_are_keys_when_keyed_else_hosts():
    a = client_of(key("k1"), "ipv4:10.0.0.1:5000", keyed=True)
    assert a == client_of((("x-api-key", "k1"),), "ipv4:10.0.0.2:6000", keyed=True) and "k1" not in a
    assert a != client_of(key("k2"), "ipv4:10.0.0.1:5000", keyed=True)
    # Without keys a client cannot make itself many by sending headers.
    assert client_of(key("k1"), "ipv4:10.0.0.1:5000", keyed=False) == client_of((), "ipv4:10.0.0.1:6001", keyed=False)
    assert (peer_host("ipv4:1.2.3.4:5"), peer_host("ipv6:[::1]:5"), peer_host("unix:/tmp/s")) == (
        "1.2.3.4",
        "::1",
        "unix:/tmp/s",
    )
