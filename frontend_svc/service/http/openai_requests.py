"""OpenAI request bodies -> plain values: ``/v1/completions`` and ``/v1/chat/completions``.

    JSON body ── completion_request() / chat_request() ──▶ OpenAIRequest
                   .input: GenerateInput   (the same plain values the gRPC face makes; planning checks them)
                   .stream, .include_usage, .continuous_usage, .echo, .logprobs ...  (how to answer)

Fields are read as the OpenAI API defines them, plus vLLM's documented extras where
Tandem has the feature (top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, include_stop_str_in_output, skip_special_tokens, prompt_logprobs,
priority, chat_template_kwargs, reasoning_effort, truncate_prompt_tokens). Every other
field is refused first, with what to do instead (allow_list.py: one table per kind).
Tool calling (``tools``, ``tool_choice``, ``parallel_tool_calls``, tool turns) is read
by ``openai_tools``; vLLM's structured-output fields by ``structured_fields``.

``param_name`` turns planning's gRPC field paths back into these names for errors.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from frontend_svc.service.http import allow_list
from frontend_svc.service.http.errors import bad_request
from frontend_svc.service.http.fields import Fields
from frontend_svc.service.http.openai_tools import message_extras, tool_param, tool_request
from frontend_svc.service.http.prompts import completion_prompts
from frontend_svc.service.http.structured_fields import GUIDED, structured_constraint
from frontend_svc.service.planning import Chat, GenerateInput
from frontend_svc.text.nesting import too_deep
from tandem_common.sampling import DEFAULT_MAX_TOKENS, SamplingParams, StructuredOutput


@dataclass
class OpenAIRequest:
    input: GenerateInput
    model: str | None
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    echo: bool = False  # completions: the prompt text before the output
    logprobs: bool = False  # return logprobs (chat: content[]; completions: tokens/token_logprobs/...)
    num_logprobs: int | None = None  # completions' logprobs: alternatives per token
    echo_only: bool = False  # completions echo with max_tokens 0: the prompt alone (echo.py)
    num_prompt_logprobs: int | None = None  # the client's own prompt_logprobs (None: not answered)
    prompts: list[GenerateInput] = field(default_factory=list)  # completions: every prompt (input: the first)
    constraint_field: str = "response_format"  # the field that set the output constraint, if any
    best_of_keep: int | None = None  # best_of > n: answer these many of input.n choices (the likeliest)

    def param_name(self, path: str) -> str:
        """``param_name``, with an engine's error about the constraint (a regex that does not
        compile) naming the field this request set it with."""
        name = param_name(path)
        return self.constraint_field if name in ("response_format", "structured_outputs") else name


def completion_request(body) -> OpenAIRequest:
    allow_list.check(body, allow_list.COMPLETIONS)
    f = Fields(body)
    prompt = body.get("prompt") if isinstance(body, dict) else None
    num_logprobs = f.int("logprobs", lo=0)
    echo = f.bool("echo", False)
    if echo and f.int("truncate_prompt_tokens") is not None:
        # The echo is the prompt as sent; its logprobs and offsets would be the kept tokens'.
        raise bad_request("truncate_prompt_tokens", "cannot be combined with echo: send the prompt you want echoed")
    gen = _sampling(f, logprobs=num_logprobs)
    keep = _best_of(f, gen)
    num_prompt_logprobs = gen.params.prompt_logprobs
    echo_only = echo and gen.max_tokens_set and gen.params.max_tokens == 0
    if echo_only:  # the engine runs for one token at least; the answer leaves it out
        gen.params = replace(gen.params, max_tokens=1)
    if echo and num_logprobs is not None:  # every choice's logprobs start with the prompt's
        gen.params = replace(gen.params, prompt_logprobs=max(num_logprobs, num_prompt_logprobs or 0))
        gen.prompt_logprobs_each_choice = True
    gen.add_special_tokens = f.bool("add_special_tokens", True)
    prompts = completion_prompts(prompt, gen)  # one or several (prompts.py)
    return OpenAIRequest(
        prompts[0],
        f.str("model"),
        echo=echo,
        logprobs=num_logprobs is not None,
        num_logprobs=num_logprobs,
        echo_only=echo_only,
        num_prompt_logprobs=num_prompt_logprobs,
        prompts=prompts,
        constraint_field=_constraint_field(f),
        best_of_keep=keep,
        **_stream(f),
    )


def chat_request(body, *, check_fields: bool = True) -> OpenAIRequest:
    """``check_fields`` False: a body that only renders (POST /tokenize), whose own fields differ."""
    if check_fields:
        allow_list.check(body, allow_list.CHAT)
    f = Fields(body)
    logprobs = f.bool("logprobs", False)
    top = f.int("top_logprobs", lo=0)
    if top is not None and not logprobs:
        raise bad_request("top_logprobs", "needs logprobs: true")
    gen = _sampling(f, logprobs=(top or 0) if logprobs else None)
    keep = _best_of(f, gen)
    kwargs = f.object("chat_template_kwargs")
    problem = too_deep(kwargs.body) if kwargs is not None else None
    if problem is not None:
        raise bad_request("chat_template_kwargs", problem)
    gen.input = "messages"
    gen.chat = Chat(
        chat_messages(f),
        f.bool("add_generation_prompt", True),
        template_kwargs=_reasoning_effort(f) | (dict(kwargs.body) if kwargs is not None else {}),
    )
    gen.tools = tool_request(f)
    return OpenAIRequest(
        gen,
        f.str("model"),
        logprobs=logprobs,
        num_prompt_logprobs=gen.params.prompt_logprobs,
        constraint_field=_constraint_field(f),
        best_of_keep=keep,
        **_stream(f),
    )


# OpenAI's values of reasoning_effort; the template reads the variable (vLLM passes it the same way).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def _reasoning_effort(f: Fields) -> dict[str, str]:
    """reasoning_effort as a template variable (chat_template_kwargs, sent too, wins)."""
    effort = f.str("reasoning_effort")
    if effort is None:
        return {}
    if effort not in REASONING_EFFORTS:
        raise bad_request("reasoning_effort", f"must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}")
    return {"reasoning_effort": effort}


def chat_messages(f: Fields, key: str = "messages") -> list[dict[str, Any]]:
    """Messages as {"role", "content"} with text content (a string, or an array of text
    parts), plus an assistant's tool_calls and a tool turn's tool_call_id."""
    messages = f.list(key)
    if messages is None:
        raise bad_request(key, "is required: an array of {role, content} messages")
    out = []
    for i, m in enumerate(messages):
        mf = Fields(m, f"{key}[{i}]")
        role = mf.str("role")
        if not role:
            raise bad_request(mf.name("role"), "is required (system, user, assistant ...)")
        out.append({"role": role, "content": message_text(mf), **message_extras(mf)})
    return out


def message_text(mf: Fields, part_types: tuple[str, ...] = ("text",)) -> str:
    """A message's ``content``: a string, or an array of text parts (of ``part_types``) joined."""
    content = mf.raw("content", "")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(mf.name("content"), "must be a string or an array of content parts")
    parts = []
    for j, part in enumerate(content):
        pf = Fields(part, f"{mf.name('content')}[{j}]")
        kind = pf.raw("type")
        if kind not in part_types:
            raise bad_request(pf.name("type"), f"only text content ({', '.join(part_types)}) is served, got {kind!r}")
        parts.append(pf.str("text", ""))
    return "".join(parts)


def _stream(f: Fields) -> dict:
    stream = f.bool("stream", False)
    options = f.object("stream_options")
    include = options.bool("include_usage", False) if options is not None else False
    continuous = options.bool("continuous_usage_stats", False) if options is not None else False
    continuous = include and continuous  # only beside include_usage, as vLLM reads it
    if options is not None and not stream:
        raise bad_request("stream_options", "is only allowed with stream: true")
    return {"stream": stream, "include_usage": include, "continuous_usage": continuous}


def _sampling(f: Fields, *, logprobs: int | None) -> GenerateInput:
    """The sampling fields both endpoints share; the prompt is filled in by the caller."""
    max_tokens = f.int("max_completion_tokens")
    if max_tokens is None:
        max_tokens = f.int("max_tokens")
    seed = f.int("seed")
    if seed is not None and not -(1 << 63) <= seed < 1 << 63:
        raise bad_request("seed", f"must be a signed 64-bit integer, in [-2**63, 2**63 - 1], got {seed}")
    n = f.int("n", 1)
    params = SamplingParams(
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        min_tokens=f.int("min_tokens", 0),
        temperature=f.float("temperature", 1.0),
        top_p=f.float("top_p", 1.0),
        top_k=f.int("top_k", 0),
        min_p=f.float("min_p", 0.0),
        presence_penalty=f.float("presence_penalty", 0.0),
        frequency_penalty=f.float("frequency_penalty", 0.0),
        repetition_penalty=f.float("repetition_penalty", 1.0),
        seed=seed % (1 << 64) if seed is not None else None,  # OpenAI seeds are signed 64-bit
        stop_token_ids=f.ints("stop_token_ids"),
        ignore_eos=f.bool("ignore_eos", False),
        logprobs=logprobs,
        prompt_logprobs=f.int("prompt_logprobs"),
        logit_bias=_logit_bias(f),
        structured=_constraint(f),
    )
    return GenerateInput(
        input=None,
        cache_salt=cache_salt(f),
        params=params,
        max_tokens_set=max_tokens is not None,
        n=n,
        truncate_prompt_tokens=_truncate_prompt_tokens(f),
        stop=f.str_or_strs("stop"),
        include_stop_str_in_output=f.bool("include_stop_str_in_output", False),
        skip_special_tokens=f.bool("skip_special_tokens", True),
        priority=f.int("priority", 0),
    )


def cache_salt(f: Fields) -> str | None:
    """vLLM's ``cache_salt``: this request's prompt shares prefix-cache blocks only with
    requests of the same salt. ``session_id`` (vLLM's, for sessions Tandem does not keep) is
    refused rather than ignored."""
    if f.has("session_id"):
        raise bad_request(
            "session_id", "is not served: Tandem keeps no sessions; send the conversation, and cache_salt to isolate it"
        )
    salt = f.str("cache_salt")
    if salt == "":
        raise bad_request("cache_salt", "must be a non-empty string when given")
    return salt


def _best_of(f: Fields, gen: GenerateInput) -> int | None:
    """best_of as OpenAI defines it: generate best_of choices, answer the n with the highest
    cumulative logprob (the sum over their tokens). Equal to n it asks for nothing more
    (None); larger, ``gen`` asks for best_of choices with the sampled tokens' logprobs (0
    alternatives, unless the client asked for more) and the answer keeps n (returned).
    Streaming cannot: the best are known only once every choice has finished."""
    best_of = f.int("best_of")
    n = gen.n
    if best_of is None or best_of == n:
        return None
    if best_of < n:
        raise bad_request("best_of", f"must be at least n ({n}), got {best_of}")
    if f.bool("stream", False):
        raise bad_request("best_of", f"must equal n ({n}) when streaming: the best choices are known only at the end")
    gen.n = best_of
    if gen.params.logprobs is None:
        gen.params.logprobs = 0  # the sampled tokens' logprobs, for the sums; not returned
    return n


def _truncate_prompt_tokens(f: Fields) -> int | None:
    """vLLM's truncate_prompt_tokens: keep the last k prompt tokens (-1: as many as the context
    holds); the plan checks k against the model's context."""
    k = f.int("truncate_prompt_tokens")
    if k is not None and k < -1:
        raise bad_request("truncate_prompt_tokens", f"must be -1 (the context) or at least 0, got {k}")
    return k


def _constraint(f: Fields) -> StructuredOutput | None:
    """The output constraint: response_format, or vLLM's structured_outputs / guided_* (one at most)."""
    openai = _response_format(f)
    vllm = structured_constraint(f)
    if vllm is None:
        return openai
    if openai is not None:
        raise bad_request(vllm[0], "only one output constraint is allowed, and response_format sets one")
    return vllm[1]


def _constraint_field(f: Fields) -> str:
    """The field the request's constraint came from (the converter allows one at most)."""
    return next((name for name in ("structured_outputs", *GUIDED) if f.has(name)), "response_format")


def _logit_bias(f: Fields) -> dict[int, float]:
    bias = f.object("logit_bias")
    if bias is None:
        return {}
    out = {}
    for key in bias.body:
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request("logit_bias", f"keys must be token ids, got {key!r}") from None
        out[token_id] = bias.float(key, 0.0)
    return out


def _response_format(f: Fields) -> StructuredOutput | None:
    """response_format as the engine's structured output: json_schema, json_object, or text (none)."""

    def schema(rf: Fields) -> Any:
        js = rf.object("json_schema")
        return js.raw("schema") if js is not None else None

    return format_constraint(f.object("response_format"), "response_format", schema, "json_schema.schema")


def format_constraint(
    fmt: Fields | None, name: str, schema: Callable[[Fields], Any], schema_path: str
) -> StructuredOutput | None:
    """A response format (chat's ``response_format``, the Responses API's ``text.format``,
    named ``name``) as the engine's structured output; ``schema`` reads a json_schema
    format's schema, which sits at ``schema_path`` within it."""
    if fmt is None:
        return None
    kind = fmt.str("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutput(kind="json_object")
    if kind == "json_schema":
        body = schema(fmt)
        if not isinstance(body, dict):
            raise bad_request(f"{name}.{schema_path}", "is required: a JSON Schema object")
        problem = too_deep(body)
        if problem is not None:
            raise bad_request(f"{name}.{schema_path}", problem)
        return StructuredOutput(kind="json_schema", text=json.dumps(body))
    raise bad_request(f"{name}.type", f"must be text, json_object or json_schema, got {kind!r}")


_RENAMED = {"text": "prompt", "token_ids": "prompt", "token_ids.ids": "prompt", "input": "prompt"}


def param_name(path: str) -> str:
    """A planning field path (``sampling_params.top_p``, ``messages.messages``) as the OpenAI parameter."""
    head = path.split("[", 1)[0]
    if head in _RENAMED:
        return _RENAMED[head]
    if head.startswith("messages"):
        return "messages"
    name = path.removeprefix("sampling_params.")
    head = name.split(".", 1)[0].split("[", 1)[0]
    if head in ("json_schema", "json_object", "structured", "constraint"):
        return "response_format"
    if head in ("regex", "choice", "grammar"):  # only vLLM's fields set these kinds
        return "structured_outputs"
    return tool_param(name)
