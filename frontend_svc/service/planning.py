"""Generate requests checked and planned, in plain values: GenerateInput -> Plan, or a CallError.

    GenerateRequest ── convert.request_sizes() ──▶ RequestSizes ── check_sizes()    (lengths only, O(1))
    GenerateRequest ── convert.generate_input() ──▶ GenerateInput
    GenerateInput ── prepare_generate() ──▶ Prepared  (tools checked; a chat's ChatPrompt)
    ChatPrompt ── Generation.render() ──▶ prompt text (the chat template, in its render processes)
    GenerateInput, Prepared, text ── plan_generate() ──▶ Plan   (prompt tokenized, every field checked)
                                                     └──▶ CallError(code, "field: what to fix")

Every size is checked before the work it would make expensive: the lengths of repeated
fields before anything is copied, the length of a text before it is tokenized, the
length of a token-id prompt before its ids are looked at. docs/limits.md lists the limits.

No grpc and no protobuf here: an error carries an ErrorCode, which names the gRPC status
the servicer ends the call with. INVALID_ARGUMENT messages start with the field's path in
the public API, e.g. "sampling_params.top_p: must be in (0, 1], got 2.0".
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from frontend_svc.service import message_plan
from frontend_svc.service.message_plan import ChatRendering, OutputParsers
from frontend_svc.text.chat_roles import check_roles
from frontend_svc.text.output_processor import TextParams
from frontend_svc.text.tokenizer import Tokenizer
from frontend_svc.text.tools.spec import MAX_TOOLS, ToolRequest
from frontend_svc.types import CallError, ModelInfo
from tandem_common.block_hash import MAX_CACHE_SALT_BYTES
from tandem_common.sampling import SamplingParams, check_sampling_params
from tandem_common.sampling import check_sizes as check_sampling_sizes
from tandem_common.types import ErrorCode

_U64 = 1 << 64  # seeds are uint64 on the wire

# The frontend's own fixed limits (the sampling ones both services share are in
# tandem_common.sampling; n and the stop strings are set by flags, see RequestLimits).
MAX_CHAT_MESSAGES = 1024  # turns of one conversation (Generate and Tokenize)
MAX_REQUEST_ID_CHARS = 256  # a client's request_id; it goes into every log line of the call
MAX_DETOKENIZE_IDS = 1 << 20  # token ids of one Detokenize call
_REQUEST_VARIABLES = ("messages", "add_generation_prompt")  # template variables a client's kwargs cannot set


def invalid(field: str, message: str) -> CallError:
    return CallError(ErrorCode.INVALID_ARGUMENT, f"{field}: {message}")


@dataclass(frozen=True)
class RequestLimits:
    """The frontend's limits that an operator sets by flag (--max-n, --max-stop-strings,
    --max-stop-string-chars)."""

    max_n: int = 16
    max_stop_strings: int = 16
    max_stop_string_chars: int = 1024


@dataclass(frozen=True)
class RequestSizes:
    """The lengths of a Generate request's repeated fields, read without copying them."""

    input: str | None  # which prompt field is set, as in GenerateInput
    num_token_ids: int = 0
    num_messages: int = 0
    num_stop: int = 0
    num_stop_token_ids: int = 0
    num_logit_bias: int = 0
    request_id_chars: int = 0
    num_tools: int = 0


@dataclass
class Chat:
    """A conversation to render with the model's chat template."""

    # {"role": ..., "content": ...}, plus "tool_calls" ([{"id", "name", "arguments"}]),
    # "tool_call_id" and "name" where the turn has them
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    enable_thinking: bool | None = None  # passed to the template when set
    template_kwargs: dict = field(default_factory=dict)  # extra variables for the template (HTTP chat_template_kwargs)


@dataclass
class ChatPrompt:
    """A conversation as the chat template gets it: the turns, whether to open the
    assistant's turn, the other variables (tools, enable_thinking, the client's own)."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool
    variables: dict[str, Any]


@dataclass
class Prepared:
    """What a request needs rendered before it is planned: nothing, or a chat's prompt and
    how its output is read (tools, reasoning)."""

    rendering: ChatRendering | None = None
    prompt: ChatPrompt | None = None


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
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: as many as fit)
    tools: ToolRequest = field(default_factory=ToolRequest)
    lora_name: str | None = None  # the LoRA adapter the client's model names (checked: Generation.lora_name)
    # Every choice gets the prompt logprobs, not choice 0 alone (HTTP completions' echo with
    # logprobs: each choice's logprobs start with the prompt's). Each such choice computes
    # its prompt in full: the engine serves prompt logprobs from no cached block.
    prompt_logprobs_each_choice: bool = False
    cache_salt: str | None = None  # the prefix cache shared only with the same salt (block_hash.salted)


@dataclass
class Plan:
    """A checked Generate request in plain values."""

    prompt_token_ids: list[int]
    n: int
    params: SamplingParams  # choice 0's; choice i gets seed + i and no prompt logprobs (unless each choice asks)
    text: TextParams
    priority: int
    lora_name: str | None = None  # the LoRA adapter to run under; None: the base model
    prompt_logprobs_each_choice: bool = False  # GenerateInput's
    cache_salt: str | None = None  # GenerateInput's, checked

    def engine_params(self, i: int) -> SamplingParams:
        if i == 0:
            return self.params
        seed = None if self.params.seed is None else (self.params.seed + i) % _U64
        if self.prompt_logprobs_each_choice:
            return replace(self.params, seed=seed)
        return replace(self.params, seed=seed, prompt_logprobs=None)

    def text_params(self, i: int) -> TextParams:
        return self.text if i == 0 or self.prompt_logprobs_each_choice else replace(self.text, prompt_logprobs=False)

    @property
    def every_choice_misses(self) -> bool:
        """Whether every choice asks for prompt logprobs, so none hits the prefix cache."""
        return self.text.prompt_logprobs and (self.n == 1 or self.prompt_logprobs_each_choice)


def check_sizes(sizes: RequestSizes, limits: RequestLimits, info: ModelInfo) -> None:
    """The size limits, from lengths alone; call it before the request is converted."""
    if sizes.request_id_chars > MAX_REQUEST_ID_CHARS:
        raise invalid(
            "request_id", f"at most {MAX_REQUEST_ID_CHARS} characters are allowed, got {sizes.request_id_chars}"
        )
    if sizes.input == "token_ids" and sizes.num_token_ids >= info.max_model_len:
        raise invalid("token_ids.ids", _too_long(sizes.num_token_ids, info.max_model_len))
    if sizes.input == "messages":
        check_num_messages("messages.messages", sizes.num_messages)
    if sizes.num_tools > MAX_TOOLS:
        raise invalid("tools", f"at most {MAX_TOOLS} tools are allowed, got {sizes.num_tools}")
    if sizes.num_stop > limits.max_stop_strings:
        raise invalid(
            "sampling_params.stop", f"at most {limits.max_stop_strings} stop strings are allowed, got {sizes.num_stop}"
        )
    error = check_sampling_sizes(sizes.num_stop_token_ids, sizes.num_logit_bias)
    if error is not None:
        raise invalid(f"sampling_params.{error.name}", error.message)


def check_num_messages(field: str, num_messages: int) -> None:
    if num_messages > MAX_CHAT_MESSAGES:
        raise invalid(field, f"at most {MAX_CHAT_MESSAGES} messages are allowed, got {num_messages}")


def prepare_generate(request: GenerateInput, tokenizer: Tokenizer, parsers: OutputParsers | None = None) -> Prepared:
    """The tools checked and, for a chat, what its template renders; CallError for the
    first problem. The sizes are checked already (``check_sizes``)."""
    parsers = parsers or OutputParsers()
    message_plan.check_tool_request(request.tools, request.input == "messages")
    if request.input != "messages" or request.chat is None:
        return Prepared()
    chat = request.chat
    rendering = message_plan.prepare(chat.messages, request.tools, chat.enable_thinking, tokenizer, parsers)
    return Prepared(rendering, chat_prompt(chat, tokenizer, rendering.messages, rendering.template_kwargs))


def plan_generate(
    request: GenerateInput,
    tokenizer: Tokenizer,
    info: ModelInfo,
    limits: RequestLimits,
    parsers: OutputParsers | None = None,
    prepared: Prepared | None = None,
    prompt_text: str = "",
) -> Plan:
    """Tokenizes the prompt (a chat's: ``prompt_text``, rendered from ``prepared.prompt``)
    and checks every field; raises CallError for the first problem."""
    parsers = parsers or OutputParsers()
    prepared = prepared or Prepared()
    if prepared.prompt is not None:
        prompt = encode_prompt("messages", prompt_text, tokenizer, info.max_model_len, add_special_tokens=False)
    else:
        prompt = _prompt(request, tokenizer, info)
    which = request.input or "input"  # set: _prompt refuses a request without one
    if request.truncate_prompt_tokens is not None:
        prompt = truncated(prompt, request.truncate_prompt_tokens, request.params, request.max_tokens_set, info)
    if not prompt:
        raise invalid(which, "the prompt is empty after tokenization")
    if len(prompt) >= info.max_model_len:
        raise invalid(which, _too_long(len(prompt), info.max_model_len))

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
    check_params(params, request.n, request.stop, info.vocab_size, limits)
    message, params, skip_special_tokens = message_plan.finish(
        prepared.rendering, prompt_text, request.tools, params, request.skip_special_tokens, tokenizer, parsers
    )
    text = TextParams(
        stop=list(request.stop),
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=skip_special_tokens,
        min_tokens=params.min_tokens,
        return_token_ids=request.return_token_ids,
        prompt_logprobs=params.prompt_logprobs is not None,
        message=message,
    )
    check_cache_salt(request.cache_salt)
    return Plan(
        prompt,
        request.n,
        params,
        text,
        request.priority,
        request.lora_name,
        request.prompt_logprobs_each_choice,
        request.cache_salt,
    )


def check_cache_salt(salt: str | None) -> None:
    if salt is not None and len(salt.encode()) > MAX_CACHE_SALT_BYTES:
        raise invalid("cache_salt", f"is {len(salt.encode())} bytes; the limit is {MAX_CACHE_SALT_BYTES}")


def truncated(prompt: list[int], k: int, params: SamplingParams, max_tokens_set: bool, info: ModelInfo) -> list[int]:
    """The prompt's last ``k`` tokens (vLLM's truncate_prompt_tokens: the start of a long
    conversation is what goes). -1 keeps as many as leave room for max_tokens (1 when unset);
    a ``k`` over the context is refused: no prompt that long can run."""
    if k > info.max_model_len:
        raise invalid(
            "truncate_prompt_tokens", f"must be at most the model's context of {info.max_model_len} tokens, got {k}"
        )
    if k == -1:
        k = max(1, info.max_model_len - (params.max_tokens if max_tokens_set else 1))
    return prompt[-k:] if k else []


def _too_long(num_tokens: int, max_model_len: int) -> str:
    return (
        f"the prompt has {num_tokens} tokens but the model's context is "
        f"{max_model_len} tokens; shorten it to at most {max_model_len - 1}"
    )


def _prompt(request: GenerateInput, tokenizer: Tokenizer, info: ModelInfo) -> list[int]:
    if request.input is None:
        raise invalid("input", "set one of text, token_ids or messages")
    if request.input == "text":
        if not request.text:
            raise invalid("text", "the prompt text is empty")
        return encode_prompt("text", request.text, tokenizer, info.max_model_len, request.add_special_tokens)
    if request.input == "token_ids":
        if not request.token_ids:
            raise invalid("token_ids.ids", "the prompt has no token ids")
        check_ids("token_ids.ids", request.token_ids, info.vocab_size)
        return request.token_ids
    raise invalid("messages", "the conversation is missing")  # prepare_generate makes a chat's prompt


def encode_prompt(
    field: str, text: str, tokenizer: Tokenizer, max_model_len: int | None, add_special_tokens: bool
) -> list[int]:
    """Token ids of a prompt text; text that can never fit the context is refused first
    (``max_model_len`` None: no engine has told the context yet, nothing is refused).

    No token stands for more characters of (normalized) text than the vocabulary's longest
    entry, so a text longer than (max_model_len - 1) times that needs more tokens than the
    context holds: refused in O(length), before tokenizing, which takes seconds and about
    100 bytes of memory per character of text. This assumes a tokenizer that drops no text
    (true of the byte-level and SentencePiece BPE tokenizers of the Llama family).
    """
    if max_model_len is None:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    limit = (max_model_len - 1) * tokenizer.max_token_chars
    if len(text) > limit:
        num_chars = tokenizer.normalized_len(text)
        if num_chars > limit:
            raise invalid(
                field,
                f"the text has {num_chars} characters, more than fit the model's context of {max_model_len} "
                f"tokens: no token of this model stands for more than {tokenizer.max_token_chars} characters, "
                f"so at most {limit} characters can fit; shorten it",
            )
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def check_params(p: SamplingParams, n: int, stop: list[str], vocab_size: int, limits: RequestLimits) -> None:
    """n, then the limits both services share (tandem_common.sampling), then the stop strings."""
    if not 1 <= n <= limits.max_n:
        raise invalid("sampling_params.n", f"must be in [1, {limits.max_n}], got {n}")
    error = check_sampling_params(p, vocab_size)
    if error is not None:
        raise invalid(f"sampling_params.{error.name}", error.message)
    for i, s in enumerate(stop):
        if not s:
            raise invalid(f"sampling_params.stop[{i}]", "stop strings must not be empty")
        if len(s) > limits.max_stop_string_chars:
            raise invalid(
                f"sampling_params.stop[{i}]",
                f"at most {limits.max_stop_string_chars} characters are allowed, got {len(s)}",
            )


def check_ids(field: str, ids, vocab_size: int) -> None:
    """Token ids given as input (a prompt, Detokenize) must lie inside the vocabulary."""
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):  # C speed; the loop only names the culprit
        return
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise invalid(field, f"{field}[{i}] = {t} is outside the vocabulary [0, {vocab_size})")


def chat_prompt(
    chat: Chat, tokenizer: Tokenizer, messages: list[dict[str, Any]], template_kwargs: dict[str, Any]
) -> ChatPrompt:
    """``chat`` checked and made ready for the model's chat template (``messages``: its
    turns as the template reads them; ``template_kwargs``: tools, enable_thinking)."""
    if not tokenizer.has_chat_template:
        raise invalid("messages", "the model has no chat template; send text or token_ids instead")
    if not chat.messages:
        raise invalid("messages.messages", "the conversation has no messages")
    bad_role = check_roles(chat.messages, tokenizer.special_tokens)
    if bad_role is not None:
        raise invalid(f"messages.messages[{bad_role[0]}].role", bad_role[1])
    clash = next((name for name in _REQUEST_VARIABLES if name in chat.template_kwargs), None)
    if clash is not None:
        raise invalid("chat_template_kwargs", f"{clash!r} is the request's own; leave it out of chat_template_kwargs")
    # The plan's own variables (tools, enable_thinking) win over the client's.
    return ChatPrompt(messages, chat.add_generation_prompt, {**chat.template_kwargs, **template_kwargs})
