"""The engine protocol (tandem.engine.v1) <-> the frontend's plain types, both ways.

    SamplingParams, ids ── add_request() / abort_request() ──▶ StreamRequest   (to the engine)
    subscribe_kv_events() ──▶ StreamRequest                                    (to the engine)
    RequestOutput  ── engine_output() ──▶ EngineOutput                         (from the engine)
    KvEvent        ── kv_events() ──▶ tandem_common.kv_events values           (from the engine)
    EngineLoad, GetModelInfoResponse ── engine_load() / model_info() ──▶ EngineLoad, ModelInfo

With the session in client.py (which opens the stubs) this is the only frontend code that
knows the engine's protobuf types; everything past it sees plain dataclasses.
"""

from __future__ import annotations

from frontend_svc.types import EngineLoad, EngineOutput, EngineRequestTooLargeError, ModelInfo, RequestError
from tandem_common.kv_events import BlocksRemoved, BlocksStored, CacheSnapshot, KvEvent
from tandem_common.sampling import SamplingParams, StructuredOutput
from tandem_common.types import ErrorCode, FinishReason, Logprob
from tandem_protos.tandem.engine.v1 import engine_pb2

_FINISH = {
    engine_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    engine_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    engine_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
    engine_pb2.FINISH_REASON_ERROR: FinishReason.ERROR,
}
_ERROR = {
    engine_pb2.ERROR_CODE_INVALID_ARGUMENT: ErrorCode.INVALID_ARGUMENT,
    engine_pb2.ERROR_CODE_RESOURCE_EXHAUSTED: ErrorCode.RESOURCE_EXHAUSTED,
    engine_pb2.ERROR_CODE_UNAVAILABLE: ErrorCode.UNAVAILABLE,
    engine_pb2.ERROR_CODE_NOT_FOUND: ErrorCode.NOT_FOUND,
}


# -- to the engine -------------------------------------------------------------------------


def add_request(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    *,
    priority: int,
    arrival_time: float,
    trace_context: dict[str, str],
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> engine_pb2.StreamRequest:
    add = engine_pb2.Add(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=_sampling_params(params),
        priority=priority,
        arrival_time=arrival_time,
        trace_context=trace_context,
        lora_name=lora_name or "",
        cache_salt=cache_salt or "",
    )
    return engine_pb2.StreamRequest(add=add)


def check_size(message: engine_pb2.StreamRequest, max_message_bytes: int) -> None:
    """gRPC fails the whole stream, every request on it, for one message over its limit: refuse it first."""
    size = message.ByteSize()
    if size > max_message_bytes:
        raise EngineRequestTooLargeError(
            f"the request is {size} bytes as an engine message, more than the {max_message_bytes} "
            "bytes the engine stream carries (--max-message-bytes); shorten the prompt or send fewer "
            "logit_bias entries or stop token ids"
        )


def abort_request(request_ids: list[str], *, stop_string: bool = False) -> engine_pb2.StreamRequest:
    """``stop_string``: the requests are complete (a stop string matched), not cancelled."""
    reason = engine_pb2.ABORT_REASON_STOP_STRING if stop_string else engine_pb2.ABORT_REASON_CANCELLED
    return engine_pb2.StreamRequest(abort=engine_pb2.Abort(request_ids=request_ids, reason=reason))


def pause_requests(request_ids: list[str]) -> engine_pb2.StreamRequest:
    return engine_pb2.StreamRequest(pause_requests=engine_pb2.PauseRequests(request_ids=request_ids))


def resume_requests(request_ids: list[str]) -> engine_pb2.StreamRequest:
    return engine_pb2.StreamRequest(resume_requests=engine_pb2.ResumeRequests(request_ids=request_ids))


def subscribe_kv_events() -> engine_pb2.StreamRequest:
    return engine_pb2.StreamRequest(subscribe_kv_events=engine_pb2.SubscribeKvEvents())


def _sampling_params(p: SamplingParams) -> engine_pb2.SamplingParams:
    sp = engine_pb2.SamplingParams(
        max_tokens=p.max_tokens,
        min_tokens=p.min_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos,
        logit_bias=p.logit_bias,
    )
    if p.seed is not None:
        sp.seed = p.seed
    if p.logprobs is not None:
        sp.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        sp.prompt_logprobs = p.prompt_logprobs
    if p.structured is not None:
        _set_structured(sp, p.structured)
    return sp


_GRAMMAR_SYNTAX = {"lark": engine_pb2.GRAMMAR_SYNTAX_LARK, "gbnf": engine_pb2.GRAMMAR_SYNTAX_GBNF}
_JSON_WHITESPACE = {"compact": engine_pb2.JSON_WHITESPACE_COMPACT, "flexible": engine_pb2.JSON_WHITESPACE_FLEXIBLE}


def _set_structured(sp: engine_pb2.SamplingParams, s: StructuredOutput) -> None:
    """Fills the ``constraint`` oneof (planning has checked ``s``)."""
    if s.kind == "json_object":
        sp.json_object = True
    elif s.kind == "choice":
        sp.choice.choices.extend(s.choices)
    elif s.kind == "grammar":
        sp.grammar.syntax = _GRAMMAR_SYNTAX[s.grammar_syntax]
        sp.grammar.text = s.text
    else:  # json_schema, regex: the text itself
        setattr(sp, s.kind, s.text)
    sp.json_whitespace = _JSON_WHITESPACE[s.json_whitespace]
    sp.json_lenient = s.json_lenient


# -- from the engine -----------------------------------------------------------------------


def engine_output(o: engine_pb2.RequestOutput) -> EngineOutput:
    out = EngineOutput(
        o.request_id,
        list(o.new_token_ids),
        num_prompt_tokens=o.num_prompt_tokens,
        num_cached_tokens=o.num_cached_tokens,
    )
    # Most outputs are one decode token and nothing else: skip what is not there.
    if o.logprobs:
        out.logprobs = [_logprob(lp) for lp in o.logprobs]
    if o.prompt_logprobs:
        out.prompt_logprobs = [_logprob(lp) for lp in o.prompt_logprobs]
    if o.finish_reason:
        out.finish_reason = _FINISH.get(o.finish_reason)
    if o.HasField("stop_token_id"):
        out.stop_token_id = o.stop_token_id
    if o.HasField("error"):
        out.error = RequestError(_ERROR.get(o.error.code, ErrorCode.INTERNAL), o.error.message, o.error.field)
    return out


def _logprob(lp: engine_pb2.TokenLogprob) -> Logprob:
    return Logprob(lp.token_id, lp.logprob, lp.rank, [(t.token_id, t.logprob) for t in lp.top])


def kv_events(events) -> list[KvEvent]:
    """A StreamResponse's kv_events as plain values, in order; unknown kinds are skipped."""
    out: list[KvEvent] = []
    for e in events:
        kind = e.WhichOneof("event")
        if kind == "stored":
            parent = e.stored.parent_block_hash if e.stored.HasField("parent_block_hash") else None
            out.append(BlocksStored(tuple(e.stored.block_hashes), parent))
        elif kind == "removed":
            out.append(BlocksRemoved(tuple(e.removed.block_hashes)))
        elif kind == "snapshot":
            s = e.snapshot
            out.append(CacheSnapshot(tuple(s.block_hashes), first=s.first, last=s.last))
    return out


def engine_load(load: engine_pb2.EngineLoad) -> EngineLoad:
    return EngineLoad(
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        draining=load.draining,
        num_used_blocks=load.num_used_blocks,
        num_waiting_tokens=load.num_waiting_tokens,
        lora_version=load.lora_version,
    )


def model_info(info: engine_pb2.GetModelInfoResponse) -> ModelInfo:
    return ModelInfo(
        model_name=info.model_name,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        eos_token_ids=list(info.eos_token_ids),
        bos_token_id=info.bos_token_id if info.HasField("bos_token_id") else None,
        block_size=info.block_size or 16,
        num_kv_blocks=info.num_kv_blocks,
        block_hash_algorithm=info.block_hash_algorithm,
        lora_adapters={a.name: a.digest for a in info.lora_adapters},
    )
