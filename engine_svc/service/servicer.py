"""EngineService over gRPC: the only engine module that knows protobuf.

It converts control messages into plain commands for the EngineLoop and per-step
EngineOutputs back into StreamResponses. Each stream's outputs wait in a bounded
StreamBacklog (service/backlog.py) until its reader takes them: a reader that lags gets
merged, split messages, and one that lags far pauses its requests instead of making the
engine buffer without bound.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from engine_svc.outputs import EngineOutput, EngineStats, RejectedAdd
from engine_svc.service.backlog import (
    KV_EVENTS_MAX_HASHES,
    KV_HASH_WIRE_BYTES,
    MAX_MESSAGE_BYTES,
    MAX_OUTPUTS_PER_MESSAGE,
    MESSAGE_OVERHEAD_BYTES,
    Batch,
    StreamBacklog,
)
from engine_svc.service.engine_loop import AddCommand, EngineLoop
from engine_svc.types import DEFAULT_MAX_TOKENS, ErrorCode, FinishReason, Logprob, SamplingParams
from tandem_common.kv_events import BlocksRemoved, BlocksStored, KvEvent
from tandem_common.sampling import StructuredOutput
from tandem_common.tokenizer_files import SERVED_TOKENIZER_FILE_NAMES
from tandem_protos.tandem.engine.v1 import engine_pb2 as pb
from tandem_protos.tandem.engine.v1 import engine_pb2_grpc

logger = logging.getLogger(__name__)

TOKENIZER_CHUNK_BYTES = 1 << 20
_CHUNK_HEADROOM_BYTES = 4096  # file name, offsets, size and sha256 around a chunk's data

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
# What an Abort's reason makes its requests finish with.
_ABORT_FINISH = {
    pb.ABORT_REASON_UNSPECIFIED: FinishReason.ABORT,
    pb.ABORT_REASON_CANCELLED: FinishReason.ABORT,
    pb.ABORT_REASON_STOP_STRING: FinishReason.STOP,
}
# Request ids are echoed in every output; longer ones could not fit a bounded message.
MAX_REQUEST_ID_BYTES = 1024


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
        structured=structured_from_proto(p),
    )


_GRAMMAR_SYNTAX = {
    pb.GRAMMAR_SYNTAX_UNSPECIFIED: "lark",
    pb.GRAMMAR_SYNTAX_LARK: "lark",
    pb.GRAMMAR_SYNTAX_GBNF: "gbnf",
}
_JSON_WHITESPACE = {
    pb.JSON_WHITESPACE_UNSPECIFIED: "compact",
    pb.JSON_WHITESPACE_COMPACT: "compact",
    pb.JSON_WHITESPACE_FLEXIBLE: "flexible",
}


def structured_from_proto(p: pb.SamplingParams) -> StructuredOutput | None:
    """The ``constraint`` oneof and its options; an unknown enum number is kept as its
    number, so the shared check names it."""
    kind = p.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not p.json_object):
        return None
    return StructuredOutput(
        kind=kind,
        text=p.grammar.text if kind == "grammar" else p.json_schema if kind == "json_schema" else p.regex,
        choices=tuple(p.choice.choices),
        grammar_syntax=_GRAMMAR_SYNTAX.get(p.grammar.syntax, str(p.grammar.syntax)),
        json_whitespace=_JSON_WHITESPACE.get(p.json_whitespace, str(p.json_whitespace)),
        json_lenient=p.json_lenient,
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
        msg.error.CopyFrom(_error_to_proto(out.error))
    return msg


def _error_to_proto(error) -> pb.Error:
    return pb.Error(code=_ERROR[error.code], message=error.message, field=error.field)


def batch_to_proto(batch: Batch) -> pb.StreamResponse:
    response = pb.StreamResponse(outputs=[output_to_proto(o) for o in batch.outputs])
    if batch.rejected:
        response.rejected.extend(
            pb.RejectedAdd(request_id=r.request_id, error=_error_to_proto(r.error)) for r in batch.rejected
        )
    if batch.kv_events:
        response.kv_events.extend(kv_event_to_proto(e) for e in batch.kv_events)
    if batch.stats is not None:
        response.load.CopyFrom(load_to_proto(batch.stats))
    return response


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
        num_paused=stats.num_paused,
        num_waiting_tokens=stats.num_waiting_tokens,
        kv_cache_usage=stats.kv_cache_usage,
        prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
        num_used_blocks=stats.num_used_blocks,
        draining=stats.draining,
    )


class _MalformedCommand(ValueError):
    """A control message that parses but breaks the protocol; ends the stream."""


async def _raise_reader_failure(reader: asyncio.Task, context) -> None:
    """Ends the Stream call with its reader's failure, if the reader failed."""
    if not reader.done() or reader.cancelled() or reader.exception() is None:
        return
    error = reader.exception()
    if isinstance(error, (DecodeError, _MalformedCommand)):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed control message: {error}")
    raise error


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    """Serves one EngineLoop. ``loop`` is None until the model is loaded and warmed up."""

    def __init__(self, max_message_bytes: int = 16 * 1024 * 1024, stream_backlog_bytes: int = 16 << 20) -> None:
        self.engine: EngineLoop | None = None
        self.model_info: pb.GetModelInfoResponse | None = None
        self.model_dir: Path | None = None
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

    def attach(self, engine: EngineLoop, model_info: pb.GetModelInfoResponse, model_dir: Path) -> None:
        self.engine, self.model_info, self.model_dir = engine, model_info, model_dir

    async def _require_engine(self, context) -> EngineLoop:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is still loading its model; retry shortly")
        return self.engine

    async def close_streams(self, timeout: float) -> None:
        """Shutdown: end every open Stream with UNAVAILABLE once its last outputs are sent.

        The engine half-closes every stream (after the requests' final outputs), so each
        writer sends what it holds and ends its call. Ending them here, rather than leaving
        them to the server's stop, keeps a routine shutdown from cancelling the handlers
        (which gRPC logs as errors with tracebacks).
        """
        self._closing = True
        if self.engine is not None:
            self.engine.half_close_all()
        deadline = asyncio.get_running_loop().time() + timeout
        while self._open_streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)

    async def Stream(self, request_iterator, context):
        engine = await self._require_engine(context)
        if self._closing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is shutting down; use another engine")
        backlog = StreamBacklog(
            max_message_bytes=self.stream_message_bytes - MESSAGE_OVERHEAD_BYTES,  # the load figures take the rest
            max_outputs=MAX_OUTPUTS_PER_MESSAGE,
            pause_bytes=self.stream_backlog_bytes,
            max_hashes=self.kv_max_hashes,
        )
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()  # the backlog has something, or the reader failed
        taken = asyncio.Event()  # the writer took from the backlog (the reader may go on)

        def sink(items: list[EngineOutput | RejectedAdd] | None, stats: EngineStats) -> bool:
            """On the engine thread: queue, wake the writer; True asks to pause the stream."""
            lagging = False
            if items is None:
                backlog.finish(stats)
            else:
                lagging = backlog.put(items, stats)
            notify()
            return lagging

        def kv_sink(events: list[KvEvent], stats: EngineStats) -> None:
            """On the engine thread: one batch of prefix-cache events (a subscribed stream)."""
            backlog.put_events(events, stats)
            notify()

        def notify() -> None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the event loop closed (server shutdown): nobody reads
                pass

        sid = engine.open_stream(sink)
        self._open_streams.add(sid)
        if self._closing:  # opened while the engine was half-closing the others
            engine.half_close(sid)
        reader = asyncio.create_task(
            self._read_commands(
                engine,
                sid,
                request_iterator,
                backlog,
                taken,
                lambda: engine.subscribe_kv_events(sid, kv_sink, self.kv_max_hashes),
            )
        )
        # A malformed control message must end the call even when no step output is due.
        reader.add_done_callback(lambda _: wake.set())
        try:
            while True:
                await wake.wait()
                wake.clear()
                await _raise_reader_failure(reader, context)
                while True:
                    batch = backlog.take()
                    if batch.resume:
                        engine.resume_stream(sid)
                    if batch.outputs or batch.rejected or batch.kv_events:
                        yield batch_to_proto(batch)
                        taken.set()
                        await _raise_reader_failure(reader, context)
                    if batch.done:
                        if self._closing:
                            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine shut down; use another engine")
                        return
                    if not (batch.outputs or batch.rejected or batch.kv_events):
                        break
        finally:
            self._open_streams.discard(sid)
            reader.cancel()
            engine.close_stream(sid)

    async def _read_commands(
        self,
        engine: EngineLoop,
        sid: int,
        request_iterator,
        backlog: StreamBacklog,
        taken: asyncio.Event,
        subscribe: Callable[[], None],
    ) -> None:
        try:
            async for msg in request_iterator:
                action = msg.WhichOneof("action")
                if action == "add":
                    add = msg.add
                    if len(add.request_id.encode()) > MAX_REQUEST_ID_BYTES:
                        raise _MalformedCommand(
                            f"request_id is {len(add.request_id.encode())} bytes; at most {MAX_REQUEST_ID_BYTES}"
                        )
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
                    reason = _ABORT_FINISH.get(msg.abort.reason, FinishReason.ABORT)
                    engine.abort(sid, list(msg.abort.request_ids), reason)
                elif action == "subscribe_kv_events":
                    subscribe()
                # Far behind: stop reading, so HTTP/2 flow control holds the client's writes.
                while backlog.over_read_limit:
                    taken.clear()
                    await taken.wait()
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
        files = [self.model_dir / name for name in SERVED_TOKENIZER_FILE_NAMES if (self.model_dir / name).is_file()]
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
