"""EngineService over gRPC: the only engine module that knows protobuf.

It converts control messages into plain commands for the EngineLoop and per-step
EngineOutputs back into StreamResponses.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from engine_svc.outputs import EngineOutput, EngineStats
from engine_svc.service.engine_loop import AddCommand, EngineLoop
from engine_svc.types import DEFAULT_MAX_TOKENS, ErrorCode, FinishReason, Logprob, SamplingParams
from tandem_common.kv_events import BlocksRemoved, BlocksStored, KvEvent, num_hashes
from tandem_protos.tandem.engine.v1 import engine_pb2 as pb
from tandem_protos.tandem.engine.v1 import engine_pb2_grpc

logger = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
)
TOKENIZER_CHUNK_BYTES = 1 << 20
_CHUNK_HEADROOM_BYTES = 4096  # file name, offsets, size and sha256 around a chunk's data
# Prefix-cache events per stream message: at most this many block hashes, and at most a
# quarter of the message size limit (a hash takes 34 bytes on the wire; 40 leaves room for
# the events around them). 4096 hashes are about 140 KiB; a snapshot of a large cache
# (1 GiB of KV at 16 tokens a block can be 65k blocks) spans several messages.
KV_EVENTS_MAX_HASHES = 4096
_KV_HASH_WIRE_BYTES = 40

_FINISH = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}
_ERROR = {
    ErrorCode.INVALID_ARGUMENT: pb.ERROR_CODE_INVALID_ARGUMENT,
    ErrorCode.RESOURCE_EXHAUSTED: pb.ERROR_CODE_RESOURCE_EXHAUSTED,
    ErrorCode.UNAVAILABLE: pb.ERROR_CODE_UNAVAILABLE,
    ErrorCode.INTERNAL: pb.ERROR_CODE_INTERNAL,
}


def sampling_params_from_proto(p: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=p.max_tokens if p.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        min_tokens=p.min_tokens,
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        top_k=p.top_k,
        min_p=p.min_p,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        seed=p.seed if p.HasField("seed") else None,
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        logit_bias=dict(p.logit_bias),
    )


def _logprob_to_proto(lp: Logprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        rank=lp.rank,
        top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def output_to_proto(out: EngineOutput) -> pb.RequestOutput:
    msg = pb.RequestOutput(
        request_id=out.request_id,
        new_token_ids=out.new_token_ids,
        finish_reason=_FINISH[out.finish_reason],
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
    )
    if out.logprobs:
        msg.logprobs.extend(_logprob_to_proto(lp) for lp in out.logprobs)
    if out.prompt_logprobs:
        msg.prompt_logprobs.extend(_logprob_to_proto(lp) for lp in out.prompt_logprobs)
    if out.stop_token_id is not None:
        msg.stop_token_id = out.stop_token_id
    if out.error is not None:
        msg.error.CopyFrom(pb.Error(code=_ERROR[out.error.code], message=out.error.message, field=out.error.field))
    return msg


def kv_event_to_proto(event: KvEvent) -> pb.KvEvent:
    if isinstance(event, BlocksStored):
        return pb.KvEvent(
            stored=pb.KvBlocksStored(parent_block_hash=event.parent_hash, block_hashes=event.block_hashes)
        )
    if isinstance(event, BlocksRemoved):
        return pb.KvEvent(removed=pb.KvBlocksRemoved(block_hashes=event.block_hashes))
    return pb.KvEvent(snapshot=pb.KvSnapshot(first=event.first, last=event.last, block_hashes=event.block_hashes))


def load_to_proto(stats: EngineStats) -> pb.EngineLoad:
    return pb.EngineLoad(
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_waiting_tokens=stats.num_waiting_tokens,
        kv_cache_usage=stats.kv_cache_usage,
        prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
        num_used_blocks=stats.num_used_blocks,
        draining=stats.draining,
    )


async def _raise_reader_failure(reader: asyncio.Task, context) -> None:
    """Ends the Stream call with its reader's failure, if the reader failed."""
    if not reader.done() or reader.cancelled() or reader.exception() is None:
        return
    error = reader.exception()
    if isinstance(error, DecodeError):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed control message: {error}")
    raise error


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    """Serves one EngineLoop. ``loop`` is None until the model is loaded and warmed up."""

    def __init__(self, max_message_bytes: int = 16 * 1024 * 1024) -> None:
        self.engine: EngineLoop | None = None
        self.model_info: pb.GetModelInfoResponse | None = None
        self.model_dir: Path | None = None
        # A chunk plus its header must fit the server's send limit (--max-message-bytes),
        # or a tokenizer.json larger than the limit could never be handed out.
        self.tokenizer_chunk_bytes = max(1024, min(TOKENIZER_CHUNK_BYTES, max_message_bytes - _CHUNK_HEADROOM_BYTES))
        self.kv_max_hashes = max(1, min(KV_EVENTS_MAX_HASHES, max_message_bytes // 4 // _KV_HASH_WIRE_BYTES))

    def attach(self, engine: EngineLoop, model_info: pb.GetModelInfoResponse, model_dir: Path) -> None:
        self.engine, self.model_info, self.model_dir = engine, model_info, model_dir

    async def _require_engine(self, context) -> EngineLoop:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is still loading its model; retry shortly")
        return self.engine

    async def Stream(self, request_iterator, context):
        engine = await self._require_engine(context)
        # Items: (outputs, stats, kv events); outputs None once the stream is done.
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        sid = engine.open_stream(lambda outs, stats: loop.call_soon_threadsafe(queue.put_nowait, (outs, stats, ())))

        def subscribe() -> None:
            def kv_sink(events, stats) -> None:
                loop.call_soon_threadsafe(queue.put_nowait, ([], stats, events))

            engine.subscribe_kv_events(sid, kv_sink, self.kv_max_hashes)

        reader = asyncio.create_task(self._read_commands(engine, sid, request_iterator, subscribe))

        def wake_on_failure(task: asyncio.Task) -> None:
            # A malformed control message must end the call even when no step output is due.
            if not task.cancelled() and task.exception() is not None:
                queue.put_nowait((None, None, ()))

        reader.add_done_callback(wake_on_failure)
        held = None  # an item that did not fit the last message
        try:
            while True:
                outs, stats, kv = held or await queue.get()
                held = None
                if outs is None:
                    await _raise_reader_failure(reader, context)
                    return
                batch, events = list(outs), list(kv)
                # A reader that fell behind gets the queued steps merged into one message, as
                # long as its prefix-cache events stay within kv_max_hashes.
                done = False
                while not queue.empty():
                    item = queue.get_nowait()
                    if item[0] is None:
                        done = True
                        break
                    if item[2] and num_hashes(events) + num_hashes(item[2]) > self.kv_max_hashes:
                        held = item
                        break
                    batch.extend(item[0])
                    events.extend(item[2])
                    stats = item[1]
                yield pb.StreamResponse(
                    outputs=[output_to_proto(o) for o in batch],
                    load=load_to_proto(stats),
                    kv_events=[kv_event_to_proto(e) for e in events],
                )
                await _raise_reader_failure(reader, context)
                if done:
                    return
        finally:
            reader.cancel()
            engine.close_stream(sid)

    async def _read_commands(
        self, engine: EngineLoop, sid: int, request_iterator, subscribe: Callable[[], None]
    ) -> None:
        try:
            async for msg in request_iterator:
                action = msg.WhichOneof("action")
                if action == "add":
                    add = msg.add
                    engine.add(
                        sid,
                        AddCommand(
                            request_id=add.request_id,
                            prompt_token_ids=list(add.prompt_token_ids),
                            sampling_params=sampling_params_from_proto(add.sampling_params),
                            priority=add.priority,
                            arrival_time=add.arrival_time or None,
                            trace_context=dict(add.trace_context),
                        ),
                    )
                elif action == "abort":
                    engine.abort(sid, list(msg.abort.request_ids))
                elif action == "subscribe_kv_events":
                    subscribe()
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            engine.close_stream(sid)
            raise
        engine.half_close(sid)

    async def GetModelInfo(self, request, context):
        await self._require_engine(context)
        return self.model_info

    async def GetLoad(self, request, context):
        engine = await self._require_engine(context)
        return pb.GetLoadResponse(load=load_to_proto(engine.stats))

    async def GetTokenizer(self, request, context):
        await self._require_engine(context)
        files = [self.model_dir / name for name in TOKENIZER_FILES if (self.model_dir / name).is_file()]
        if not files:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no tokenizer files in {self.model_dir.name}")
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
