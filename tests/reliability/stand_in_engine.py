"""A stand-in engine that speaks tandem.engine.v1 as a faulty or hostile one would.

It serves in the test's own event loop on 127.0.0.1, port 0. GetModelInfo and
GetTokenizer are forwarded to a real engine (so a frontend accepts the stand-in as serving
the same model), with ``num_kv_blocks`` overridden when asked; GetLoad reports an idle
engine. Its Stream reads every control message and answers none of them (a black hole: the
step loop of an engine that died while its gRPC server lives on), except that a
subscription to prefix-cache events gets a snapshot of ``num_published_blocks`` made-up
block hashes, far more than the pool it reports.
"""

from __future__ import annotations

import asyncio

import grpc

from tandem_protos.tandem.engine.v1 import engine_pb2 as pb
from tandem_protos.tandem.engine.v1 import engine_pb2_grpc

SNAPSHOT_PART = 20_000  # hashes per snapshot message


class StandInEngine(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self, real_address: str, *, num_kv_blocks: int | None = None, num_published_blocks: int = 0) -> None:
        self.real_address = real_address
        self.num_kv_blocks = num_kv_blocks
        self.num_published_blocks = num_published_blocks
        self.num_adds = 0  # Add messages received, over all streams
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self._channel: grpc.aio.Channel | None = None

    async def start(self) -> StandInEngine:
        self._channel = grpc.aio.insecure_channel(self.real_address)
        self.server = grpc.aio.server()
        engine_pb2_grpc.add_EngineServiceServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)
        if self._channel is not None:
            await self._channel.close()

    async def GetModelInfo(self, request, context):
        info = await engine_pb2_grpc.EngineServiceStub(self._channel).GetModelInfo(request, timeout=10)
        if self.num_kv_blocks is not None:
            info.num_kv_blocks = self.num_kv_blocks
            info.kv_capacity_tokens = self.num_kv_blocks * info.block_size
        return info

    async def GetTokenizer(self, request, context):
        async for chunk in engine_pb2_grpc.EngineServiceStub(self._channel).GetTokenizer(request, timeout=30):
            yield chunk

    async def GetLoad(self, request, context):
        return pb.GetLoadResponse(load=pb.EngineLoad())

    async def Stream(self, request_iterator, context):
        async for message in request_iterator:
            if message.HasField("add"):
                self.num_adds += 1
            elif message.HasField("subscribe_kv_events"):
                for response in self._snapshot():
                    yield response
                    await asyncio.sleep(0)

    def _snapshot(self):
        n = self.num_published_blocks
        starts = range(0, max(n, 1), SNAPSHOT_PART)
        for i, start in enumerate(starts):
            hashes = [h.to_bytes(8, "little") for h in range(start + 1, min(start + SNAPSHOT_PART, n) + 1)]
            part = pb.KvSnapshot(first=i == 0, last=i == len(starts) - 1, block_hashes=hashes)
            yield pb.StreamResponse(kv_events=[pb.KvEvent(snapshot=part)])
