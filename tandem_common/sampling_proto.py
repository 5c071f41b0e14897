"""A protobuf ``SamplingParams`` -> the plain SamplingParams, for both services.

The public API (tandem.generate.v1) and the engine protocol (tandem.engine.v1) spell the
token-level sampling fields alike: same names, same presence (``optional`` where "unset"
differs from zero), the same ``constraint`` oneof and the same enum value names. So one
function reads either message by field name; the public message's text-level fields (n,
stop strings, skip_special_tokens...) are the frontend's to read. No generated code is
imported here (tandem_common stays below the protobuf boundaries): enum values are read by
name through the message's descriptor.

Unset ``optional`` fields get their documented default, never zero; limits are checked
afterwards by ``tandem_common.sampling.check_sampling_params`` on the plain value.
"""

from __future__ import annotations

from typing import Any

from tandem_common.sampling import DEFAULT_MAX_TOKENS, SamplingParams, StructuredOutput

# Either service's generated SamplingParams; both have every field read here.
SamplingParamsMessage = Any


def sampling_params_from_proto(p: SamplingParamsMessage) -> SamplingParams:
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


def structured_from_proto(p: SamplingParamsMessage) -> StructuredOutput | None:
    """The ``constraint`` oneof and its options. Two constraints at once cannot reach here
    (protobuf keeps the last member of a oneof); an unknown enum number is kept as its
    number, so the shared check (``check_structured_output``) names it."""
    kind = p.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not p.json_object):
        return None
    return StructuredOutput(
        kind=kind,
        text=p.grammar.text if kind == "grammar" else p.json_schema if kind == "json_schema" else p.regex,
        choices=tuple(p.choice.choices),
        grammar_syntax=_enum_option(p.grammar, "syntax", "GRAMMAR_SYNTAX_", unset="lark"),
        json_whitespace=_enum_option(p, "json_whitespace", "JSON_WHITESPACE_", unset="compact"),
        json_lenient=p.json_lenient,
    )


def _enum_option(message: Any, field_name: str, prefix: str, *, unset: str) -> str:
    """An enum field as its lower-case name without ``prefix`` (``GRAMMAR_SYNTAX_GBNF`` ->
    ``gbnf``); ``unset`` for the ``*_UNSPECIFIED`` zero, the number itself if unknown."""
    number = getattr(message, field_name)
    value = message.DESCRIPTOR.fields_by_name[field_name].enum_type.values_by_number.get(number)
    if value is None:
        return str(number)
    name = value.name.removeprefix(prefix).lower()
    return unset if name == "unspecified" else name
