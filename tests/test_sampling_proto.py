"""One SamplingParams conversion for both protocols: the public API's message and the
engine protocol's read alike, unset optional fields get their defaults, enum values map
by name and an unknown one is kept as its number."""

from __future__ import annotations

import pytest

from tandem_common.sampling import DEFAULT_MAX_TOKENS, SamplingParams, StructuredOutput, check_structured_output
from tandem_common.sampling_proto import sampling_params_from_proto
from tandem_protos.tandem.engine.v1 import engine_pb2
from tandem_protos.tandem.generate.v1 import generate_pb2

PROTOCOLS = [generate_pb2, engine_pb2]

FIELDS = dict(
    max_tokens=9,
    min_tokens=2,
    temperature=0.0,
    top_p=0.5,
    top_k=40,
    min_p=0.25,
    presence_penalty=0.5,
    frequency_penalty=-0.5,
    repetition_penalty=1.25,
    seed=2**63,
    stop_token_ids=[3, 1, 3],
    ignore_eos=True,
    logprobs=0,
    prompt_logprobs=5,
    logit_bias={7: -100.0, 2: 0.5},
)


@pytest.mark.parametrize("pb", PROTOCOLS, ids=lambda pb: pb.__name__)
def test_every_token_level_field_is_read(pb):
    params = sampling_params_from_proto(pb.SamplingParams(**FIELDS))
    assert params == SamplingParams(**FIELDS)


@pytest.mark.parametrize("pb", PROTOCOLS, ids=lambda pb: pb.__name__)
def test_unset_optional_fields_get_their_defaults_not_zero(pb):
    assert sampling_params_from_proto(pb.SamplingParams()) == SamplingParams()
    assert SamplingParams().max_tokens == DEFAULT_MAX_TOKENS
    zeros = sampling_params_from_proto(pb.SamplingParams(temperature=0.0, top_p=0.0, repetition_penalty=0.0, seed=0))
    assert (zeros.temperature, zeros.top_p, zeros.repetition_penalty, zeros.seed) == (0.0, 0.0, 0.0, 0)


@pytest.mark.parametrize("pb", PROTOCOLS, ids=lambda pb: pb.__name__)
def test_constraints_and_their_options(pb):
    def structured(**kw):
        return sampling_params_from_proto(pb.SamplingParams(**kw)).structured

    assert structured() is None
    assert structured(json_object=False) is None
    assert structured(json_object=True, json_whitespace=pb.JSON_WHITESPACE_FLEXIBLE) == StructuredOutput(
        "json_object", json_whitespace="flexible"
    )
    assert structured(json_schema='{"type": "integer"}', json_lenient=True) == StructuredOutput(
        "json_schema", '{"type": "integer"}', json_lenient=True
    )
    assert structured(regex="a+") == StructuredOutput("regex", "a+")
    assert structured(choice=pb.Choice(choices=["yes", "no"])) == StructuredOutput("choice", choices=("yes", "no"))
    assert structured(grammar=pb.Grammar(text="start: 'x'")) == StructuredOutput("grammar", "start: 'x'")
    assert structured(grammar=pb.Grammar(syntax=pb.GRAMMAR_SYNTAX_GBNF, text="root ::= 'x'")) == StructuredOutput(
        "grammar", "root ::= 'x'", grammar_syntax="gbnf"
    )


@pytest.mark.parametrize("pb", PROTOCOLS, ids=lambda pb: pb.__name__)
def test_an_unknown_enum_number_is_kept_so_the_shared_check_names_it(pb):
    s = sampling_params_from_proto(pb.SamplingParams(grammar=pb.Grammar(syntax=7, text="x"))).structured
    assert s is not None and s.grammar_syntax == "7"
    error = check_structured_output(s)
    assert error is not None and "7" in error.message
    s = sampling_params_from_proto(pb.SamplingParams(json_object=True, json_whitespace=9)).structured
    assert s is not None and s.json_whitespace == "9"
