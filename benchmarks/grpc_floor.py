"""What one streamed gRPC message costs a Python server on this machine, with no Tandem code.

    python -m benchmarks.grpc_floor [--streams 32] [--messages 100] [--tick-ms 20]

A bare ``grpc.aio`` server (a separate process) streams ``--messages`` small messages on
each of ``--streams`` concurrent calls, the way the frontend streams tokens: every
``--tick-ms`` (one engine step) each call wakes up and sends one message. A second run
sends the same messages back to back. Printed: the server process's CPU time per message
(user + system), which is the floor under the frontend's CPU per token
when it sends one message per token (``--stream-interval 1``).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time

import grpc

from benchmarks.serve_load import process_cpu_s

_METHOD = "/floor.Floor/Stream"
_PAYLOAD = b"x" * 40  # about one token's text, index and id


def _same(x: bytes) -> bytes:
    return x


async def _serve(ports: mp.Queue, messages: int, tick_s: float) -> None:
    step = asyncio.Event()

    async def ticker() -> None:
        nonlocal step
        while True:
            await asyncio.sleep(tick_s)
            step.set()
            step = asyncio.Event()

    async def stream(request: bytes, context):
        paced = request == b"paced"
        for _ in range(messages):
            if paced:
                await step.wait()
            yield _PAYLOAD

    handler = grpc.method_handlers_generic_handler(
        "floor.Floor",
        {"Stream": grpc.unary_stream_rpc_method_handler(stream, request_deserializer=_same, response_serializer=_same)},
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    tick = asyncio.create_task(ticker())
    ports.put(port)
    try:
        await server.wait_for_termination()
    finally:
        tick.cancel()


def _server_main(ports: mp.Queue, messages: int, tick_s: float) -> None:
    asyncio.run(_serve(ports, messages, tick_s))


async def _drive(port: int, streams: int, mode: bytes) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream(_METHOD, request_serializer=_same, response_deserializer=_same)

        async def one() -> int:
            return sum([1 async for _ in call(mode)])

        await one()  # warm-up, untimed
        return sum(await asyncio.gather(*(one() for _ in range(streams))))


def measure(streams: int, messages: int, tick_ms: float) -> dict:
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    server = ctx.Process(target=_server_main, args=(ports, messages, tick_ms / 1000), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)
        result = {}
        for name, mode in (("paced", b"paced"), ("back_to_back", b"burst")):
            cpu0, t0 = process_cpu_s(server.pid), time.perf_counter()
            sent = asyncio.run(_drive(port, streams, mode))
            wall, cpu = time.perf_counter() - t0, process_cpu_s(server.pid) - cpu0
            result[name] = {
                "messages": sent,
                "wall_s": round(wall, 3),
                "server_cpu_us_per_message": round(cpu / sent * 1e6, 1),
            }
        return result
    finally:
        server.terminate()
        server.join(timeout=10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.grpc_floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=32, help="concurrent calls (default: 32)")
    p.add_argument("--messages", type=int, default=100, help="messages per call (default: 100)")
    p.add_argument("--tick-ms", type=float, default=20.0, help="paced run: one message per call per tick (default: 20)")
    args = p.parse_args(argv)
    for name, figures in measure(args.streams, args.messages, args.tick_ms).items():
        print(
            f"{name:13s} {figures['messages']} messages in {figures['wall_s']} s: "
            f"server CPU {figures['server_cpu_us_per_message']} us per message"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
