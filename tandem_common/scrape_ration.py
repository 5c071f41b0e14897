"""How often /metrics may be asked for: one token bucket for all clients, one per address.

    connection ─▶ all clients' bucket (max_rate /s) ── empty ─▶ not accepted yet: it waits in
            │                                                   the kernel's listen queue, costing nothing
            └──▶ its address's bucket (client_rate /s) ── empty ─▶ 429 Too Many Requests + Retry-After
                         │
                         └──▶ the page (cached; renders have a ration of their own, metrics.py)

A scrape costs the service mostly per connection (accepting it, reading its head,
answering, closing: 100-200 us of CPU and GIL in a service here, a 429 as much as a cached
page), and its renders (a 0.8 ms frontend page, a 2 ms engine page, rationed to 1% of a
core). So ``max_rate`` bounds what any number of scrapers can take from the service, 2-3%
of a core at the default (measured under a ~500/s flood: 7-12% before the bound),
whatever they send; the address buckets share that out, so that one scraper asking too
often gets 429s and leaves pages for the others.
"""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_CLIENT_RATE = 20.0  # pages/s per address: Prometheus scrapes every 15 s, `watch` twice a second
DEFAULT_MAX_RATE = 100.0  # connections/s from all clients: 1-2% of a core at 100-200 us each
CLIENT_BURST_S = 2.0  # an address may use this many seconds of its rate at once
MAX_TRACKED_CLIENTS = 4096  # addresses remembered; the least recent is forgotten (a full bucket)


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` saved; ``take`` spends one if there is one."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._stamp = now

    def _refill(self, now: float) -> None:
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    def ready(self, now: float) -> bool:
        self._refill(now)
        return self._tokens >= 1

    def take(self, now: float) -> bool:
        if not self.ready(now):
            return False
        self._tokens -= 1
        return True

    def wait_s(self, now: float, tokens: float = 1.0) -> float:
        """Seconds until ``tokens`` are there (at most ``burst``; 0: they are)."""
        self._refill(now)
        return max(0.0, (min(tokens, self.burst) - self._tokens) / self.rate)


class ClientBuckets:
    """One TokenBucket per address, ``rate`` a second (burst CLIENT_BURST_S of it, at least 1);
    ``rate`` 0: no per-address limit."""

    def __init__(self, rate: float, max_clients: int = MAX_TRACKED_CLIENTS) -> None:
        self.rate = rate
        self.burst = max(1.0, rate * CLIENT_BURST_S)
        self.max_clients = max_clients
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()  # least recently seen first

    def admit(self, address: str, now: float) -> float:
        """0 when ``address`` may have a page now (its token spent), else the seconds until it may."""
        if not self.rate:
            return 0.0
        bucket = self._buckets.pop(address, None)
        if bucket is None:
            bucket = TokenBucket(self.rate, self.burst, now)
            if len(self._buckets) >= self.max_clients:
                self._buckets.popitem(last=False)  # forgotten: it comes back with a full bucket
        self._buckets[address] = bucket
        return 0.0 if bucket.take(now) else bucket.wait_s(now)


def describe(client_rate: float, max_rate: float) -> str:
    """The ration as the start-up log line says it."""
    per_client = f"{client_rate:g} pages/s per client address" if client_rate else "no limit per client address"
    return f"{per_client}, {max_rate:g} connections/s in all"
