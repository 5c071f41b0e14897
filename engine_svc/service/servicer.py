"""EngineService over gRPC: the RPCs, each a few lines over the engine loop.

The protobuf conversions live in ``service/convert.py``; each open Stream call is one
``StreamSession`` (``service/stream.py``), which owns its bounded backlog: a reader that
lags gets merged, split messages, and one that lags far pauses its requests instead of
making the engine buffer without bound. The servicer listens before the model is loaded
and answers UNAVAILABLE until ``attach`` hands it the loaded engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from engine_svc.lora_registry import LoraRefusedError
from engine_svc.outputs import ModelInfo
from engine_svc.service import convert
from engine_svc.service.backlog import KV_EVENTS_MAX_HASHES, KV_HASH_WIRE_BYTES, MAX_MESSAGE_BYTES
from engine_svc.service.engine_loop import EngineLoop
from engine_svc.service.stream import MalformedCommand, StreamSession
from tandem_common.tokenizer_files import SERVED_TOKENIZER_FILE_NAMES
from tandem_protos.tandem.engine.v1 import engine_pb2 as pb
from tandem_protos.tandem.engine.v1 import engine_pb2_grpc

logger = logging.getLogger(__name__)

TOKENIZER_CHUNK_BYTES = 1 << 20
LORA_RPC_TIMEOUT_S = 60.0  # the engine thread applies a load or unload between two steps
_CHUNK_HEADROOM_BYTES = 4096  # file name, offsets, size and sha256 around a chunk's data


@dataclass(frozen=True)
class LoadedEngine:
    """What the servicer serves once the model is loaded: set whole, in one assignment."""

    loop: EngineLoop
    model_info: ModelInfo
    model_dir: Path  # the tokenizer files are read from here


_ENGINE_DIED = "the engine's loop failed (see its log); it serves nothing more: use another engine"


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    """Serves one EngineLoop. ``loaded`` is None until the model is loaded and warmed up."""

    def __init__(self, max_message_bytes: int = 16 * 1024 * 1024, stream_backlog_bytes: int = 16 << 20) -> None:
        self.loaded: LoadedEngine | None = None
        # A chunk plus its header must fit the server's send limit (--max-message-bytes),
        # or a tokenizer.json larger than the limit could never be handed out.
        self.tokenizer_chunk_bytes = max(1024, min(TOKENIZER_CHUNK_BYTES, max_message_bytes - _CHUNK_HEADROOM_BYTES))
        # Stream messages stay well under the limit: a quarter of it, 4 MiB at most.
        self.stream_message_bytes = min(MAX_MESSAGE_BYTES, max_message_bytes // 4)
        self.stream_backlog_bytes = stream_backlog_bytes
        # Prefix-cache events ride in the same messages: at most as many hashes as fill that size again.
        self.kv_max_hashes = max(1, min(KV_EVENTS_MAX_HASHES, self.stream_message_bytes // KV_HASH_WIRE_BYTES))
        self._open_streams: set[int] = set()
        self._closing = False  # shutting down: open streams end once flushed, new ones are refused

    def attach(self, loaded: LoadedEngine) -> None:
        self.loaded = loaded

    async def _require_engine(self, context: grpc.aio.ServicerContext) -> LoadedEngine:
        if self.loaded is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is still loading its model; retry shortly")
            raise AssertionError("context.abort raises")
        if self.loaded.loop.failure is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _ENGINE_DIED)
        return self.loaded

    async def close_streams(self, timeout: float) -> None:
        """Shutdown: end every open Stream with UNAVAILABLE once its last outputs are sent.

        The engine half-closes every stream (after the requests' final outputs), so each
        writer sends what it holds and ends its call. Ending them here, rather than leaving
        them to the server's stop, keeps a routine shutdown from cancelling the handlers
        (which gRPC logs as errors with tracebacks).
        """
        self._closing = True
        if self.loaded is not None:
            self.loaded.loop.half_close_all()
        deadline = asyncio.get_running_loop().time() + timeout
        while self._open_streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)

    async def Stream(self, request_iterator, context):
        engine = (await self._require_engine(context)).loop
        if self._closing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is shutting down; use another engine")
        session = StreamSession(
            engine,
            max_message_bytes=self.stream_message_bytes,
            pause_bytes=self.stream_backlog_bytes,
            max_hashes=self.kv_max_hashes,
        )
        self._open_streams.add(session.stream_id)
        if self._closing:  # opened while the engine was half-closing the others
            engine.half_close(session.stream_id)
        try:
            async with aclosing(session.responses(request_iterator)) as responses:
                async for response in responses:
                    yield response
            if engine.failure is not None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, _ENGINE_DIED)
            if self._closing:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine shut down; use another engine")
        except (DecodeError, MalformedCommand) as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed control message: {error}")
        finally:
            self._open_streams.discard(session.stream_id)

    async def GetModelInfo(self, request, context):
        loaded = await self._require_engine(context)
        return convert.model_info_to_proto(loaded.model_info, loaded.loop.stats.lora_adapters)

    async def LoadLoraAdapter(self, request, context):
        loop = (await self._require_engine(context)).loop
        try:
            adapter = await asyncio.to_thread(loop.read_lora, request.name, request.path)
            info = await asyncio.wait_for(asyncio.wrap_future(loop.load_lora(adapter)), LORA_RPC_TIMEOUT_S)
        except LoraRefusedError as e:
            await context.abort(grpc.StatusCode[e.code.name], str(e))
        return pb.LoadLoraAdapterResponse(adapter=convert.lora_adapter_to_proto(info))

    async def UnloadLoraAdapter(self, request, context):
        loop = (await self._require_engine(context)).loop
        try:
            await asyncio.wait_for(asyncio.wrap_future(loop.unload_lora(request.name)), LORA_RPC_TIMEOUT_S)
        except LoraRefusedError as e:
            await context.abort(grpc.StatusCode[e.code.name], str(e))
        return pb.UnloadLoraAdapterResponse()

    async def GetLoad(self, request, context):
        engine = (await self._require_engine(context)).loop
        return pb.GetLoadResponse(load=convert.load_to_proto(engine.stats))

    async def GetTokenizer(self, request, context):
        model_dir = (await self._require_engine(context)).model_dir
        files = [model_dir / name for name in SERVED_TOKENIZER_FILE_NAMES if (model_dir / name).is_file()]
        if not files:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no tokenizer files in {model_dir.name}")
        for path in files:
            data = path.read_bytes()
            digest = hashlib.sha256(data).hexdigest()
            chunk = self.tokenizer_chunk_bytes
            for offset in range(0, max(len(data), 1), chunk):
                yield pb.GetTokenizerResponse(
                    file_name=path.name,
                    offset=offset,
                    data=data[offset : offset + chunk],
                    total_size=len(data),
                    sha256=digest,
                )
