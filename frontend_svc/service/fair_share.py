"""Each client's share of the frontend's call slots, so that one client cannot take them all.

    Generate ── client_of(metadata, peer) ──▶ key ── FairShare.enter(key) ── ... ── leave(key)

A client is its API key when the frontend requires keys (a digest of it: keys are never
kept or logged in clear), else its peer's host address, port dropped, since one client
opens many connections. Behind a proxy or load balancer every caller shares the proxy's
address: raise --max-calls-per-client there, or set it to 0 (no share).

The share is a count of calls in progress, checked when a call starts; past it the call
ends at once with RESOURCE_EXHAUSTED, naming the limit, before it costs anything. With
the default, half of --max-concurrent-calls, one client can take at most half the slots:
another always finds the other half free.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from frontend_svc.types import CallError
from tandem_common.types import ErrorCode


def client_of(metadata: Iterable[tuple[str, str | bytes]] | None, peer: str, *, keyed: bool) -> str:
    """Who is calling: ``key:DIGEST`` of its API key (``keyed``), else ``peer:HOST``."""
    if keyed:
        for name, value in metadata or ():
            if name in ("authorization", "x-api-key") and isinstance(value, str):
                if name == "authorization" and value.lower().startswith("bearer "):
                    value = value[len("bearer ") :]
                return "key:" + hashlib.sha256(value.strip().encode()).hexdigest()[:16]
    return "peer:" + peer_host(peer)


def peer_host(peer: str) -> str:
    """``ipv4:1.2.3.4:5678`` -> ``1.2.3.4``; ``ipv6:[::1]:5678`` -> ``::1``; others whole."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or rest
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]") or rest
    return peer


class FairShare:
    """Calls in progress per client, at most ``max_calls_per_client`` each (0: no limit)."""

    def __init__(self, max_calls_per_client: int = 0) -> None:
        self.max_calls_per_client = max_calls_per_client
        self._num_calls: dict[str, int] = {}  # only clients with calls in progress

    def enter(self, client: str) -> None:
        """Counts a call of ``client``, or raises CallError(RESOURCE_EXHAUSTED) past its share."""
        n = self._num_calls.get(client, 0)
        if self.max_calls_per_client and n >= self.max_calls_per_client:
            raise CallError(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"this client (its API key, or its address without keys) already has {n} Generate calls in "
                f"progress, its share of this frontend (--max-calls-per-client {self.max_calls_per_client}); "
                "wait for one to end before starting another",
            )
        self._num_calls[client] = n + 1

    def leave(self, client: str) -> None:
        n = self._num_calls.get(client, 0) - 1
        if n > 0:
            self._num_calls[client] = n
        else:
            self._num_calls.pop(client, None)

    def num_calls(self, client: str) -> int:
        return self._num_calls.get(client, 0)
