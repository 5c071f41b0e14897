"""The public API (tandem.generate.v1) <-> plain values, both ways.

    GenerateRequest ── request_sizes() ──▶ RequestSizes          (then planning.check_sizes)
    GenerateRequest ── generate_input() ──▶ GenerateInput        (then planning.plan_generate)
    ChatMessages    ── chat() ──▶ Chat                            (Generate and Tokenize)
    ChoiceOutput    ── generate_response() ──▶ GenerateResponse   (one per streamed piece)
    ModelInfo       ── model_info_response() ──▶ GetModelInfoResponse

With the servicer this is the only frontend code that knows the public protobuf types.
Fields whose "unset" differs from zero are read with HasField, so an unset field gets
its documented default, never zero. The token-level sampling fields are read by
``tandem_common.sampling_proto``, the same function the engine reads its protocol with.
"""

from __future__ import annotations

from frontend_svc.service.planning import Chat, GenerateInput, RequestSizes
from frontend_svc.text.message_parser import AssistantMessage
from frontend_svc.text.output_processor import ChoiceOutput, LogprobText
from frontend_svc.text.tools.spec import ToolChoice, ToolRequest, ToolSpec
from frontend_svc.types import ModelInfo
from tandem_common.sampling_proto import sampling_params_from_proto
from tandem_common.types import FinishReason
from tandem_protos.tandem.generate.v1 import generate_pb2

_FINISH = {
    FinishReason.STOP: generate_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generate_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: generate_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: generate_pb2.FINISH_REASON_ERROR,
    FinishReason.TOOL_CALLS: generate_pb2.FINISH_REASON_TOOL_CALLS,
}
_TOOL_CHOICE_MODES = {
    generate_pb2.TOOL_CHOICE_MODE_UNSPECIFIED: "auto",
    generate_pb2.TOOL_CHOICE_MODE_AUTO: "auto",
    generate_pb2.TOOL_CHOICE_MODE_NONE: "none",
    generate_pb2.TOOL_CHOICE_MODE_REQUIRED: "required",
}


# -- requests in ---------------------------------------------------------------------------


def request_sizes(request: generate_pb2.GenerateRequest) -> RequestSizes:
    """The lengths of the request's repeated fields; nothing is copied."""
    sp = request.sampling_params
    which = request.WhichOneof("input")
    return RequestSizes(
        input=which,
        num_token_ids=len(request.token_ids.ids) if which == "token_ids" else 0,
        num_messages=len(request.messages.messages) if which == "messages" else 0,
        num_stop=len(sp.stop),
        num_stop_token_ids=len(sp.stop_token_ids),
        num_logit_bias=len(sp.logit_bias),
        request_id_chars=len(request.request_id),
        num_tools=len(request.tools),
    )


def generate_input(request: generate_pb2.GenerateRequest) -> GenerateInput:
    sp = request.sampling_params
    which = request.WhichOneof("input")
    params = sampling_params_from_proto(sp)  # the token-level fields, read as the engine reads them
    return GenerateInput(
        input=which,
        text=request.text,
        token_ids=list(request.token_ids.ids) if which == "token_ids" else [],
        chat=chat(request.messages) if which == "messages" else None,
        add_special_tokens=request.add_special_tokens if request.HasField("add_special_tokens") else True,
        params=params,
        max_tokens_set=sp.HasField("max_tokens"),
        n=sp.n if sp.HasField("n") else 1,
        stop=list(sp.stop),
        include_stop_str_in_output=sp.include_stop_str_in_output,
        skip_special_tokens=sp.skip_special_tokens if sp.HasField("skip_special_tokens") else True,
        return_token_ids=request.return_token_ids,
        priority=request.priority,
        tools=tool_request(request),
        cache_salt=request.cache_salt or None,
    )


def tool_request(request: generate_pb2.GenerateRequest) -> ToolRequest:
    which = request.tool_choice.WhichOneof("choice")
    if which == "function_name":
        choice = ToolChoice("function", request.tool_choice.function_name)
    else:
        mode = request.tool_choice.mode
        choice = ToolChoice(_TOOL_CHOICE_MODES.get(mode, f"unknown mode {mode}"))
    return ToolRequest(
        tuple(ToolSpec(t.name, t.description, t.parameters, t.strict) for t in request.tools),
        choice,
        request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True,
    )


def chat(messages: generate_pb2.ChatMessages) -> Chat:
    return Chat(
        [_message(m) for m in messages.messages],
        messages.add_generation_prompt if messages.HasField("add_generation_prompt") else True,
        messages.enable_thinking if messages.HasField("enable_thinking") else None,
    )


def _message(m: generate_pb2.ChatMessage) -> dict:
    out: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


# -- responses out -------------------------------------------------------------------------


def generate_response(piece: ChoiceOutput, return_token_ids: bool) -> generate_pb2.GenerateResponse:
    response = generate_pb2.GenerateResponse(index=piece.index, text=piece.text)
    if piece.reasoning:
        response.reasoning_text = piece.reasoning
    if piece.tool_calls:
        response.tool_calls.extend(
            generate_pb2.ToolCallDelta(index=c.index, id=c.id or "", name=c.name or "", arguments=c.arguments)
            for c in piece.tool_calls
        )
    if piece.message is not None:
        response.message.CopyFrom(_assistant_message(piece.message))
    # Sent once per token per stream: fields that are empty are not touched at all.
    if return_token_ids and piece.token_ids:
        response.token_ids.extend(piece.token_ids)
    if piece.logprobs:
        response.logprobs.extend(_logprob(lp) for lp in piece.logprobs)
    if piece.prompt_logprobs:
        response.prompt_logprobs.extend(_logprob(lp) for lp in piece.prompt_logprobs)
    if piece.finish_reason is not None:
        response.finish_reason = _FINISH[piece.finish_reason]
        if piece.stop_str is not None:
            response.stop_str = piece.stop_str
        elif piece.stop_token_id is not None:
            response.stop_token_id = piece.stop_token_id
    if piece.usage is not None:  # set on every finished piece
        u = piece.usage
        response.usage.CopyFrom(
            generate_pb2.Usage(
                prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens, cached_tokens=u.cached_tokens
            )
        )
    return response


def _assistant_message(m: AssistantMessage) -> generate_pb2.AssistantMessage:
    return generate_pb2.AssistantMessage(
        content=m.content,
        reasoning=m.reasoning,
        tool_calls=[generate_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in m.tool_calls],
    )


def _logprob(lp: LogprobText) -> generate_pb2.Logprob:
    return generate_pb2.Logprob(
        token_id=lp.token_id,
        token=lp.token,
        logprob=lp.logprob,
        rank=lp.rank,
        top=[generate_pb2.TopLogprob(token_id=t.token_id, token=t.token, logprob=t.logprob) for t in lp.top],
    )


def model_info_response(
    info: ModelInfo, *, has_chat_template: bool, num_engines: int, lora_adapters: list[str]
) -> generate_pb2.GetModelInfoResponse:
    response = generate_pb2.GetModelInfoResponse(
        model_name=info.model_name,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids,
        has_chat_template=has_chat_template,
        num_engines=num_engines,
        lora_adapters=lora_adapters,
    )
    if info.bos_token_id is not None:
        response.bos_token_id = info.bos_token_id
    return response
