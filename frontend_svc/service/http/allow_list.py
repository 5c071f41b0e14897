"""Every top-level request field each HTTP API knows: served, or refused with what to do instead.

    check(body, CHAT | COMPLETIONS | MESSAGES | RESPONSES ...)   a refused or unknown field ──▶ 400 naming it

One table per request kind, one line per field: the OpenAI API's fields (the ``openai``
SDK's create parameters), vLLM's documented extras, Anthropic Messages' fields. A field is

* ``SERVED``: read by the kind's converter and honoured. Some fields have no effect on an
  answer by their definition (``user``: an end-user id for the provider's abuse checks;
  ``prompt_cache_key``: a routing hint, where the prefix cache needs none): those are
  served by accepting them.
* ``Refused(what to do)``: a 400 naming the field and saying what to do instead, never a
  silent default. ``when`` narrows it to the values Tandem cannot honour (``store: true``,
  ``use_beam_search: true``), so that the neutral value a client library always sends
  stays accepted.

A field in no table is refused too (``unknown``): the OpenAI and Anthropic APIs both
answer an unrecognized argument with 400, and a misspelt ``max_token`` silently ignored
is a wrong answer with no error. Absent and ``null`` fields are never checked (the SDKs
send ``null`` for some unset fields).

To serve a refused field: teach the converter to read it, then turn its line into
``SERVED``; docs/http.md's table says the same, one row per field.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from frontend_svc.service.http.errors import bad_request


@dataclass(frozen=True)
class Refused:
    """A field Tandem does not serve: ``what`` says what to do instead; ``when(value, body)``
    limits the refusal to the values that would need the missing feature (None: any value)."""

    what: str
    when: Callable[[Any, Mapping[str, Any]], bool] | None = None

    def refuses(self, value: Any, body: Mapping[str, Any]) -> bool:
        return self.when is None or self.when(value, body)


SERVED = None  # a field its converter reads and honours
Entry = Refused | None


def _is(expected: Any) -> Callable[[Any, Mapping[str, Any]], bool]:
    """Refused unless the value is ``expected`` (the neutral value: the feature off)."""
    return lambda value, body: value != expected


def _not_in(*accepted: Any) -> Callable[[Any, Mapping[str, Any]], bool]:
    return lambda value, body: value not in accepted


def check(body: Any, fields: Mapping[str, Entry]) -> None:
    """Raises HttpError 400 for the first field of ``body`` that ``fields`` refuses or does
    not know. A body that is not an object is left to the converter (its own 400)."""
    if not isinstance(body, dict):
        return
    for name, value in body.items():
        if value is None:
            continue
        if name not in fields:
            raise bad_request(name, _unknown(name, fields))
        entry = fields[name]
        if entry is not None and entry.refuses(value, body):
            raise bad_request(name, f"is not served by this server: {entry.what}")


def _unknown(name: str, fields: Mapping[str, Entry]) -> str:
    close = difflib.get_close_matches(name, [k for k, v in fields.items() if v is None], n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"is not a field of this request{hint} (the fields served are listed in docs/http.md)"


# -- what to do instead, shared by the kinds ------------------------------------------------

_NO_STORE = "this server stores no completions; leave store out or false"
_ONE_TIER = "this server has one service tier; leave service_tier out or 'auto'"
_NO_BEAM = "beam search is not served; sample n choices instead (n, seed)"
_NO_LENGTH_PENALTY = "length_penalty applies to beam search only, which is not served; leave it out"
_NO_ALLOWED_IDS = "restrict tokens with logit_bias (-100 bans a token) or a structured output (regex, choice)"
_NO_BAD_WORDS = "ban tokens with logit_bias (-100) or constrain the output with structured_outputs"
_NO_PROCESSORS = "custom logits processors are not served; use logit_bias or structured_outputs"
_NO_TOKEN_IDS_AS_TEXT = "token ids are not returned as text; tokenize the answer with POST /tokenize"
_NO_RETURN_TOKEN_IDS = "token ids are not returned over HTTP; use the gRPC API (return_token_ids) or POST /tokenize"
_NO_KV_TRANSFER = "KV transfer between servers is arranged by the frontend itself; leave it out"
_NO_XARGS = "vLLM's custom extension arguments are not served; leave vllm_xargs out"
_NO_MULTIMODAL = "this server serves text models only; leave it out"
_NO_BACKEND = "this server has one grammar engine (llguidance); leave guided_decoding_backend out"
_NO_WHITESPACE_PATTERN = "set structured_outputs.disable_any_whitespace (compact JSON) instead of a pattern"
_NO_SPACES = "special tokens are always joined without added spaces; leave spaces_between_special_tokens out"
_NO_STRUCTURAL_TAG = "structural tags are not served; use tools with tool_choice, or structured_outputs"

# Fields every OpenAI generation request shares: the OpenAI API's and vLLM's sampling extras.
_OPENAI_COMMON: dict[str, Entry] = {
    "model": SERVED,
    "max_tokens": SERVED,
    "max_completion_tokens": SERVED,
    "temperature": SERVED,
    "top_p": SERVED,
    "n": SERVED,
    "stop": SERVED,
    "seed": SERVED,
    "presence_penalty": SERVED,
    "frequency_penalty": SERVED,
    "logit_bias": SERVED,
    "logprobs": SERVED,
    "stream": SERVED,
    "stream_options": SERVED,
    "user": SERVED,  # an end-user id for the provider's abuse checks: no effect on the answer
    "response_format": SERVED,
    # vLLM's extras
    "top_k": SERVED,
    "min_p": SERVED,
    "repetition_penalty": SERVED,
    "min_tokens": SERVED,
    "ignore_eos": SERVED,
    "stop_token_ids": SERVED,
    "include_stop_str_in_output": SERVED,
    "skip_special_tokens": SERVED,
    "prompt_logprobs": SERVED,
    "priority": SERVED,
    "request_id": SERVED,  # the call's request id, as the X-Request-Id header
    "truncate_prompt_tokens": SERVED,
    "cache_salt": SERVED,  # salted into the prefix cache's block hashes: no prefix shared across salts
    "structured_outputs": SERVED,
    "guided_json": SERVED,
    "guided_regex": SERVED,
    "guided_choice": SERVED,
    "guided_grammar": SERVED,
    "best_of": SERVED,  # best_of choices generated, the n likeliest answered (whole answers only)
    "guided_decoding_backend": Refused(_NO_BACKEND),
    "guided_whitespace_pattern": Refused(_NO_WHITESPACE_PATTERN),
    "use_beam_search": Refused(_NO_BEAM, _is(False)),
    "length_penalty": Refused(_NO_LENGTH_PENALTY, _is(1.0)),
    "allowed_token_ids": Refused(_NO_ALLOWED_IDS),
    "bad_words": Refused(_NO_BAD_WORDS, _is([])),
    "logits_processors": Refused(_NO_PROCESSORS),
    "return_tokens_as_token_ids": Refused(_NO_TOKEN_IDS_AS_TEXT, _is(False)),
    "return_token_ids": Refused(_NO_RETURN_TOKEN_IDS, _is(False)),
    "spaces_between_special_tokens": Refused(_NO_SPACES, _is(True)),
    "kv_transfer_params": Refused(_NO_KV_TRANSFER),
    "vllm_xargs": Refused(_NO_XARGS),
}

CHAT: dict[str, Entry] = {
    **_OPENAI_COMMON,
    "messages": SERVED,
    "top_logprobs": SERVED,
    "tools": SERVED,
    "tool_choice": SERVED,
    "parallel_tool_calls": SERVED,
    "reasoning_effort": SERVED,  # a template variable, as vLLM passes it
    "include_reasoning": Refused(
        "the reasoning is always returned (reasoning_content) when the server parses it; drop it in the client",
        _is(True),
    ),
    "safety_identifier": SERVED,  # as user: no effect on the answer
    "prompt_cache_key": SERVED,  # a cache-routing hint: the prefix cache and prefix routing need none
    "metadata": SERVED,  # tags of a stored completion; nothing is stored, so nothing to tag
    "store": Refused(_NO_STORE, _is(False)),
    "service_tier": Refused(_ONE_TIER, _not_in("auto", "default")),
    "prompt_cache_retention": Refused("cached prefixes live while memory allows; leave it out", _is("in_memory")),
    "prompt_cache_options": Refused("the prefix cache needs no options; leave it out"),
    "modalities": Refused("this server answers in text only; leave modalities out or ['text']", _is(["text"])),
    "audio": Refused(_NO_MULTIMODAL),
    "prediction": Refused("predicted outputs are not served; speculative decoding is set on the engine by its flags"),
    "web_search_options": Refused("web search is not served; give the model search results in the messages"),
    "verbosity": Refused("the answer's length follows the prompt and max_tokens; leave verbosity out"),
    "moderation": Refused("moderation is not served; leave it out"),
    "functions": Refused("the deprecated functions field is not served; send tools"),
    "function_call": Refused("the deprecated function_call field is not served; send tool_choice"),
    # vLLM's chat extras
    "add_generation_prompt": SERVED,
    "chat_template_kwargs": SERVED,
    "add_special_tokens": Refused(
        "a rendered chat is tokenized without added special tokens (the template writes them); leave it out or false",
        _is(False),
    ),
    "echo": Refused("a chat answer does not repeat the last message; leave echo out or false", _is(False)),
    "continue_final_message": Refused(
        "continuing the last assistant message is not served; send the prefix through /v1/completions",
        _is(False),
    ),
    "chat_template": Refused("this server renders with the model's own chat template; leave chat_template out"),
    "documents": Refused("pass documents in the messages (or chat_template_kwargs when the template reads them)"),
    "mm_processor_kwargs": Refused(_NO_MULTIMODAL),
    "media_io_kwargs": Refused(_NO_MULTIMODAL),
    "structural_tag": Refused(_NO_STRUCTURAL_TAG),
}

COMPLETIONS: dict[str, Entry] = {
    **_OPENAI_COMMON,
    "prompt": SERVED,
    "echo": SERVED,  # the prompt before the output; with logprobs, the prompt's logprobs first (null first)
    "suffix": Refused(
        "fill-in-the-middle is not served: no model template here has an infilling format; "
        "put the text after the gap in the prompt",
        _is(""),
    ),
    "add_special_tokens": SERVED,
    "prompt_embeds": Refused("prompts as embeddings are not served; send text or token ids"),
}

MESSAGES: dict[str, Entry] = {
    "model": SERVED,
    "max_tokens": SERVED,
    "messages": SERVED,
    "system": SERVED,
    "stop_sequences": SERVED,
    "stream": SERVED,
    "temperature": SERVED,
    "top_p": SERVED,
    "top_k": SERVED,
    "tools": SERVED,
    "tool_choice": SERVED,
    "thinking": SERVED,
    "metadata": SERVED,  # metadata.user_id: an end-user id for the provider's abuse checks
    "cache_control": SERVED,  # the prefix cache is automatic: every prompt is cached where memory allows
    "service_tier": Refused(
        "this server has one service tier; leave service_tier out or 'auto'", _not_in("auto", "standard_only")
    ),
    "speed": Refused("this server has one speed; leave speed out or 'standard'", _is("standard")),
    "container": Refused("code-execution containers are not served; leave container out"),
    "mcp_servers": Refused("MCP servers are not called by this server; run the tools in the client and send tools"),
    "context_management": Refused("context editing is not served; trim the messages in the client"),
    "output_config": Refused("output_config is not served; constrain a JSON answer with a forced tool (tool_choice)"),
    "output_format": Refused("output_format is not served; constrain a JSON answer with a forced tool (tool_choice)"),
    "inference_geo": Refused("this server runs where it is deployed; leave inference_geo out"),
    "diagnostics": Refused("diagnostics are not served; leave it out"),
    "user_profile_id": Refused("user profiles are not served; leave user_profile_id out"),
    "workspace_id": Refused("workspaces are not served; leave workspace_id out"),
}

# count_tokens reads what renders the prompt; generation fields are not part of its request.
_GENERATION_ONLY = (
    "max_tokens",
    "stop_sequences",
    "stream",
    "metadata",
    "service_tier",
    "temperature",
    "top_p",
    "top_k",
)
COUNT_TOKENS: dict[str, Entry] = {k: v for k, v in MESSAGES.items() if k not in _GENERATION_ONLY}

# POST /v1/responses: OpenAI's Responses API, served on the same plan as chat (the
# fields its converter reads; sampling extras as on chat).
RESPONSES: dict[str, Entry] = {
    "model": SERVED,
    "input": SERVED,
    "instructions": SERVED,
    "tools": SERVED,
    "tool_choice": SERVED,
    "parallel_tool_calls": SERVED,
    "reasoning": SERVED,
    "text": SERVED,  # text.format json_schema: the engine's constraint
    "max_output_tokens": SERVED,
    "temperature": SERVED,
    "top_p": SERVED,
    "seed": SERVED,  # this and the next four: Tandem's sampling extras, as on chat
    "top_k": SERVED,
    "min_p": SERVED,
    "repetition_penalty": SERVED,
    "ignore_eos": SERVED,
    "top_logprobs": Refused("logprobs are served on /v1/chat/completions"),
    "stream": SERVED,
    "stream_options": SERVED,
    "previous_response_id": SERVED,
    "store": SERVED,
    "metadata": SERVED,
    "user": SERVED,
    "safety_identifier": SERVED,
    "prompt_cache_key": SERVED,
    "include": SERVED,  # an empty list: its values are refused by the converter (no extra output data)
    "truncation": Refused(
        "a prompt longer than the context is refused, never cut; leave truncation out", _is("disabled")
    ),
    "service_tier": Refused(_ONE_TIER, _not_in("auto", "default")),
    "background": Refused("background responses are not served; stream the response instead", _is(False)),
    "background_options": Refused("background responses are not served; leave background_options out"),
    "conversation": Refused("conversations are not stored; chain responses with previous_response_id"),
    "context_management": Refused("context editing is not served; trim the input in the client"),
    "max_tool_calls": Refused("limit calls with tool_choice and parallel_tool_calls"),
    "prompt": Refused("stored prompt templates are not served; send instructions and input"),
    "prompt_cache_options": Refused("the prefix cache needs no options; leave it out"),
    "prompt_cache_retention": Refused("cached prefixes live while memory allows; leave it out", _is("in_memory")),
    "moderation": Refused("moderation is not served; leave it out"),
    "image": Refused(_NO_MULTIMODAL),
    "access_programs": Refused("access programs are not served; leave access_programs out"),
}

# LoRA admin (lora_admin.py), as vLLM's bodies: adapters are named here, never numbered.
LOAD_LORA: dict[str, Entry] = {"lora_name": SERVED, "lora_path": SERVED}
UNLOAD_LORA: dict[str, Entry] = {
    "lora_name": SERVED,
    "lora_int_id": Refused("adapters are known by name only; send lora_name"),
}
