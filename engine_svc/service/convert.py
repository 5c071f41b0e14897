"""The engine protocol (tandem.engine.v1) <-> the engine's plain values, both ways.

    Add            ── add_command() ──▶ AddCommand                  (then EngineLoop.add)
    AbortReason    ── abort_finish() ──▶ FinishReason               (then EngineLoop.abort)
    Batch          ── batch_to_proto() ──▶ StreamResponse            (one per backlog take)
    EngineStats    ── load_to_proto() ──▶ EngineLoad                 (GetLoad, every response)
    ModelInfo      ── model_info_to_proto() ──▶ GetModelInfoResponse (with the adapters of the moment)
    LoraAdapterInfo ── lora_adapter_to_proto() ──▶ LoraAdapter

With the server (which registers the services) this is the only engine code that knows
the generated protobuf types; the stream session and the servicer hand it plain values.
"""

from __future__ import annotations

from engine_svc.outputs import EngineOutput, EngineStats, LoraAdapterInfo, ModelInfo
from engine_svc.service.backlog import Batch
from engine_svc.service.engine_loop import AddCommand
from engine_svc.types import ErrorCode, FinishReason, Logprob, RequestError
from tandem_common.block_hash import BLOCK_HASH_ALGORITHM, LORA_BLOCK_HASH_ALGORITHM
from tandem_common.kv_events import BlocksRemoved, BlocksStored, KvEvent
from tandem_common.sampling_proto import sampling_params_from_proto
from tandem_protos.tandem.engine.v1 import engine_pb2 as pb

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
    ErrorCode.NOT_FOUND: pb.ERROR_CODE_NOT_FOUND,
}
# What an Abort's reason makes its requests finish with; an unknown reason cancels.
_ABORT_FINISH = {
    pb.ABORT_REASON_UNSPECIFIED: FinishReason.ABORT,
    pb.ABORT_REASON_CANCELLED: FinishReason.ABORT,
    pb.ABORT_REASON_STOP_STRING: FinishReason.STOP,
}


# -- control messages in ---------------------------------------------------------------------


def add_command(add: pb.Add) -> AddCommand:
    return AddCommand(
        request_id=add.request_id,
        prompt_token_ids=list(add.prompt_token_ids),
        sampling_params=sampling_params_from_proto(add.sampling_params),
        priority=add.priority,
        arrival_time=add.arrival_time or None,
        trace_context=dict(add.trace_context),
        lora_name=add.lora_name or None,
        cache_salt=add.cache_salt or None,
    )


def abort_finish(abort: pb.Abort) -> FinishReason:
    return _ABORT_FINISH.get(abort.reason, FinishReason.ABORT)


# -- responses out ---------------------------------------------------------------------------


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
    # Most outputs are one decode token and nothing else: fields that are empty are not touched.
    if out.logprobs:
        msg.logprobs.extend(_logprob_to_proto(lp) for lp in out.logprobs)
    if out.prompt_logprobs:
        msg.prompt_logprobs.extend(_logprob_to_proto(lp) for lp in out.prompt_logprobs)
    if out.stop_token_id is not None:
        msg.stop_token_id = out.stop_token_id
    if out.error is not None:
        msg.error.CopyFrom(_error_to_proto(out.error))
    return msg


def _error_to_proto(error: RequestError) -> pb.Error:
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
        lora_version=stats.lora_version,
    )


def lora_adapter_to_proto(info: LoraAdapterInfo) -> pb.LoraAdapter:
    return pb.LoraAdapter(
        name=info.name, path=info.path, digest=info.digest, max_rank=info.max_rank, loaded_at=info.loaded_at
    )


def model_info_to_proto(info: ModelInfo, adapters: tuple[LoraAdapterInfo, ...] = ()) -> pb.GetModelInfoResponse:
    msg = pb.GetModelInfoResponse(
        model_name=info.model_name,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        eos_token_ids=list(info.eos_token_ids),
        dtype=info.dtype,
        block_size=info.block_size,
        num_kv_blocks=info.num_kv_blocks,
        kv_capacity_tokens=info.kv_capacity_tokens,
        architecture=info.architecture,
        device=info.device,
        block_hash_algorithm=LORA_BLOCK_HASH_ALGORITHM if info.max_loras else BLOCK_HASH_ALGORITHM,
        lora_adapters=[lora_adapter_to_proto(a) for a in adapters],
        max_loras=info.max_loras,
    )
    if info.bos_token_id is not None:
        msg.bos_token_id = info.bos_token_id
    return msg
