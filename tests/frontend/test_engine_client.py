"""EngineClient's tokenizer download: chunks reassembled in order and each file's sha256 checked.

The real engine always sends intact files, so a small in-process EngineService stands in
for one that sends damaged ones.
"""

from __future__ import annotations

import asyncio
import hashlib

import grpc
import pytest

from frontend_svc.engine.client import EngineClient
from tandem_common.sampling import SamplingParams
from tandem_protos.tandem.engine.v1 import engine_pb2 as pb
from tandem_protos.tandem.engine.v1 import engine_pb2_grpc

FILES = {"tokenizer.json": b'{"model": "x"}' * 1000, "tokenizer_config.json": b"{}"}


class TokenizerOnlyEngine(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self, damage: str | None = None) -> None:
        self.damage = damage

    async def GetTokenizer(self, request, context):
        for name, data in FILES.items():
            digest = hashlib.sha256(data).hexdigest()
            sent = data[:-1] + b"!" if self.damage == "bytes" and name == "tokenizer.json" else data
            for offset in range(0, len(sent), 4096):
                if self.damage == "gap" and offset == 4096:
                    continue
                yield pb.GetTokenizerResponse(
                    file_name=name,
                    offset=offset,
                    data=sent[offset : offset + 4096],
                    total_size=len(data),
                    sha256=digest,
                )


@pytest.fixture
async def serve():
    servers = []

    async def start(servicer) -> EngineClient:
        server = grpc.aio.server()
        engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        client = EngineClient(f"127.0.0.1:{port}")
        client.start()
        servers.append(client)
        return client

    yield start
    for s in reversed(servers):
        await (s.close() if isinstance(s, EngineClient) else s.stop(None))


async def test_files_arrive_whole(serve):
    client = await serve(TokenizerOnlyEngine())
    assert await client.fetch_tokenizer_files() == FILES


@pytest.mark.parametrize(("damage", "message"), [("bytes", "sha256"), ("gap", "offset")])
async def test_damaged_files_are_refused(serve, damage, message):
    client = await serve(TokenizerOnlyEngine(damage))
    with pytest.raises(ValueError, match=message):
        await client.fetch_tokenizer_files()


class RejectingEngine(engine_pb2_grpc.EngineServiceServicer):
    """Answers every add with a rejection of its id (as an engine does for a duplicate id)
    and then the request's own output, which finishes it."""

    async def GetModelInfo(self, request, context):
        return pb.GetModelInfoResponse(model_name="m", max_model_len=64, vocab_size=100)

    async def Stream(self, request_iterator, context):
        async for msg in request_iterator:
            if msg.WhichOneof("action") == "add":
                rid = msg.add.request_id
                error = pb.Error(code=pb.ERROR_CODE_INVALID_ARGUMENT, message="already in flight", field="request_id")
                yield pb.StreamResponse(rejected=[pb.RejectedAdd(request_id=rid, error=error)])
                yield pb.StreamResponse(
                    outputs=[pb.RequestOutput(request_id=rid, new_token_ids=[7], finish_reason=pb.FINISH_REASON_LENGTH)]
                )


async def test_a_rejected_add_is_logged_and_never_ends_the_live_request(serve, caplog):
    client = await serve(RejectingEngine())
    for _ in range(200):
        if client.connected:
            break
        await asyncio.sleep(0.05)
    handle = client.add("r1", [1, 2], SamplingParams(max_tokens=1))
    outputs = [out async for out in handle]
    assert [(o.new_token_ids, o.error) for o in outputs] == [([7], None)]  # the rejection was not delivered
    assert "rejected an add for r1: already in flight" in caplog.text


async def test_add_sends_one_add_message_per_request():
    """Each request costs one Add on the engine stream (a second one is refused by the
    engine as a duplicate id, a wasted message and a warning per call)."""
    client = EngineClient("127.0.0.1:1")
    client._outbox, client.connected = asyncio.Queue(), True
    client.add("a", [1, 2, 3], SamplingParams(max_tokens=4))
    assert client._outbox.qsize() == 1 and client._outbox.get_nowait().add.request_id == "a"
