"""A /metrics scrape flood from a process of its own, so that the flood's own CPU never
slows the reader that measures its effect (benchmarks.abuse_frontend's metrics-flood).

    python -m benchmarks.scrape_flood flood PORT SECONDS [CONNECTIONS]   # "flooding", then JSON: answers by status
    python -m benchmarks.scrape_flood serve PORT                          # a bare endpoint to flood instead

``serve`` runs the checkout's own /metrics endpoint on an empty registry in a process that
serves nothing else: flooding it shows what the flood costs the machine (the client, the
kernel, the endpoint's CPU), flooding a service shows that plus what sharing the service's
process costs.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter

PAUSE_S = 0.014  # between one connection's scrapes: ~60 a second each, ~500 from 8


async def _scrape_loop(port: int, until: float, statuses: Counter) -> None:
    while time.monotonic() < until:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = await reader.read()
            writer.close()
            statuses[answer[9:12].decode() or "empty"] += 1
        except OSError:
            statuses["failed"] += 1
        await asyncio.sleep(PAUSE_S)


async def flood(port: int, seconds: float, connections: int = 8) -> dict[str, int]:
    statuses: Counter = Counter()
    until = time.monotonic() + seconds
    await asyncio.gather(*(_scrape_loop(port, until, statuses) for _ in range(connections)))
    return dict(statuses)


def main(argv: list[str]) -> None:
    if argv[0] == "flood":
        connections = int(argv[3]) if len(argv) > 3 else 8
        print("flooding", flush=True)
        print(json.dumps(asyncio.run(flood(int(argv[1]), float(argv[2]), connections))), flush=True)
    elif argv[0] == "serve":
        from tandem_common.metrics import new_registry, serve_metrics

        serve_metrics(int(argv[1]), new_registry(), host="127.0.0.1")
        print("serving", flush=True)
        time.sleep(3600)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
