"""Generate requests checked and planned, in plain values: GenerateInput -> Plan, or a RequestError.

    GenerateRequest ── convert.generate_input() ──▶ GenerateInput
    GenerateInput ── plan_generate() ──▶ Plan      (prompt tokenized, every field checked)
                                    └──▶ RequestError(code, "field: what to fix")

No grpc and no protobuf here: an error carries an ErrorCode, which names the gRPC status
the servicer ends the call with. INVALID_ARGUMENT messages start with the field's path in
the public API, e.g. "sampling_params.top_p: must be in (0, 1], got 2.0".
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from frontend_svc.engine.types import ModelInfo
from frontend_svc.text.output_processor import TextParams
from frontend_svc.text.tokenizer import Tokenizer
from tandem_common.sampling import SamplingParams, check_sampling_params
from tandem_common.types import ErrorCode

_U64 = 1 << 64  # seeds are uint64 on the wire


class RequestError(Exception):
    """Ends a call with the gRPC status named by ``code`` and a message that says what to fix."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def invalid(field: str, message: str) -> RequestError:
    return RequestError(ErrorCode.INVALID_ARGUMENT, f"{field}: {message}")


@dataclass
class Chat:
    """A conversation to render with the model's chat template."""

    messages: list[dict[str, str]]  # {"role": ..., "content": ...}
    add_generation_prompt: bool = True


@dataclass
class GenerateInput:
    """A Generate request as the client sent it, in plain values; nothing is checked yet.

    ``input`` names the prompt field that is set ("text", "token_ids", "messages"; None
    when none is). ``params`` holds the engine's sampling fields, unset ones at their
    defaults; ``max_tokens_set`` says whether ``params.max_tokens`` is the client's own
    (else DEFAULT_MAX_TOKENS, which the plan caps to the room the context leaves).
    """

    input: str | None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    chat: Chat | None = None
    add_special_tokens: bool = True
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens_set: bool = False
    n: int = 1
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    priority: int = 0


@dataclass
class Plan:
    """A checked Generate request in plain values."""

    prompt_token_ids: list[int]
    n: int
    params: SamplingParams  # choice 0's; choice i gets seed + i and no prompt logprobs
    text: TextParams
    priority: int

    def engine_params(self, i: int) -> SamplingParams:
        if i == 0:
            return self.params
        seed = None if self.params.seed is None else (self.params.seed + i) % _U64
        return replace(self.params, seed=seed, prompt_logprobs=None)

    def text_params(self, i: int) -> TextParams:
        return self.text if i == 0 else replace(self.text, prompt_logprobs=False)


def plan_generate(
    request: GenerateInput, tokenizer: Tokenizer, info: ModelInfo, *, max_n: int, max_stop_strings: int
) -> Plan:
    """Tokenizes the prompt and checks every field; raises RequestError for the first problem."""
    which = request.input
    prompt = _prompt(request, tokenizer, info.vocab_size)
    if not prompt:
        raise invalid(which, "the prompt is empty after tokenization")
    if len(prompt) >= info.max_model_len:
        raise invalid(
            which,
            f"the prompt has {len(prompt)} tokens but the model's context is "
            f"{info.max_model_len} tokens; shorten it to at most {info.max_model_len - 1}",
        )

    params = request.params
    room = info.max_model_len - len(prompt)
    if not request.max_tokens_set:
        params = replace(params, max_tokens=min(params.max_tokens, room))
    elif len(prompt) + params.max_tokens > info.max_model_len:  # below 1: check_sampling_params says so
        raise invalid(
            "sampling_params.max_tokens",
            (
                f"the prompt has {len(prompt)} tokens and max_tokens is {params.max_tokens}, together "
                f"{len(prompt) + params.max_tokens}, more than the model's context of {info.max_model_len} "
                f"tokens; ask for at most {room}"
            ),
        )
    check_params(params, request.n, request.stop, info.vocab_size, max_n=max_n, max_stop_strings=max_stop_strings)
    text = TextParams(
        stop=list(request.stop),
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
        min_tokens=params.min_tokens,
        return_token_ids=request.return_token_ids,
        prompt_logprobs=params.prompt_logprobs is not None,
    )
    return Plan(prompt, request.n, params, text, request.priority)


def _prompt(request: GenerateInput, tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    if request.input is None:
        raise invalid("input", "set one of text, token_ids or messages")
    if request.input == "text":
        if not request.text:
            raise invalid("text", "the prompt text is empty")
        return tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
    if request.input == "token_ids":
        if not request.token_ids:
            raise invalid("token_ids.ids", "the prompt has no token ids")
        check_ids("token_ids.ids", request.token_ids, vocab_size)
        return request.token_ids
    return render_chat(request.chat, tokenizer)


def check_params(
    p: SamplingParams, n: int, stop: list[str], vocab_size: int, *, max_n: int, max_stop_strings: int
) -> None:
    """n, then the limits both services share (tandem_common.sampling), then the stop strings."""
    if not 1 <= n <= max_n:
        raise invalid("sampling_params.n", f"must be in [1, {max_n}], got {n}")
    error = check_sampling_params(p, vocab_size)
    if error is not None:
        raise invalid(f"sampling_params.{error.name}", error.message)
    if len(stop) > max_stop_strings:
        raise invalid("sampling_params.stop", f"at most {max_stop_strings} stop strings are allowed, got {len(stop)}")
    for i, s in enumerate(stop):
        if not s:
            raise invalid(f"sampling_params.stop[{i}]", "stop strings must not be empty")


def check_ids(field: str, ids, vocab_size: int) -> None:
    """Token ids given as input (a prompt, Detokenize) must lie inside the vocabulary."""
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise invalid(field, f"{field}[{i}] = {t} is outside the vocabulary [0, {vocab_size})")


def render_chat(chat: Chat, tokenizer: Tokenizer) -> list[int]:
    """Token ids of ``chat`` rendered with the model's chat template."""
    if not tokenizer.has_chat_template:
        raise invalid("messages", "the model has no chat template; send text or token_ids instead")
    if not chat.messages:
        raise invalid("messages.messages", "the conversation has no messages")
    try:
        text = tokenizer.apply_chat_template(chat.messages, add_generation_prompt=chat.add_generation_prompt)
    except ValueError as e:
        raise invalid("messages", str(e)) from e
    # The template writes the special tokens (BOS) itself.
    return tokenizer.encode(text, add_special_tokens=False)
