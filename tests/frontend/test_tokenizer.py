"""Tokenizer: loading, encode/decode, special ids, chat templates, parity with transformers."""

from __future__ import annotations

import json
import os

import pytest

from frontend_svc.text.tokenizer import TOKENIZER_FILE_NAMES, Tokenizer
from tests.frontend.tokenizer_factory import CORPUS, KINDS, save_tokenizer_dir, tokenizer_files

MESSAGES = [
    {"role": "user", "content": "Bonjour, ça va ? 😀"},
    {"role": "assistant", "content": "Très bien, merci."},
    {"role": "user", "content": "日本の首都は？"},
]


@pytest.fixture(scope="module", params=KINDS)
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, kind):
    return save_tokenizer_dir(tmp_path_factory.mktemp("tok"), kind)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


def test_from_dir_and_from_files_agree(tok, kind):
    other = Tokenizer.from_files(tokenizer_files(kind))
    for text in CORPUS:
        assert tok.encode(text) == other.encode(text)
    assert tok.apply_chat_template(MESSAGES) == other.apply_chat_template(MESSAGES)
    assert set(tokenizer_files(kind)) <= set(TOKENIZER_FILE_NAMES)


def test_special_ids(tok):
    assert tok.bos_token_id == tok.backend.token_to_id("<s>")
    assert tok.eos_token_ids == (tok.backend.token_to_id("</s>"),)
    assert tok.all_special_ids == {tok.backend.token_to_id(t) for t in ("<unk>", "<s>", "</s>")}
    assert tok.vocab_size == tok.backend.get_vocab_size(with_added_tokens=True)


def test_encode_adds_bos_once(tok):
    ids = tok.encode("Hello world")
    assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
    assert tok.encode("Hello world", add_special_tokens=False) == ids[1:]
    # A special token written in the text is that token.
    assert tok.encode("<s>Hi", add_special_tokens=False)[0] == tok.bos_token_id


def test_decode_round_trip(tok):
    for text in CORPUS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=False).startswith("<s>")


def test_decode_rejects_ids_outside_the_vocabulary(tok):
    with pytest.raises(ValueError, match="token ids"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="token ids"):
        tok.decode([-1])


def test_byte_fallback_ids_only_for_byte_fallback_decoders(tok, kind):
    if kind == "sentencepiece":
        assert len(tok.byte_fallback_bytes) == 256
        assert tok.byte_fallback_bytes[tok.backend.token_to_id("<0xE4>")] == 0xE4
    else:
        assert tok.byte_fallback_bytes == {}


def test_chat_template(tok, kind):
    assert tok.has_chat_template
    text = tok.apply_chat_template(MESSAGES)
    if kind == "sentencepiece":  # template in tokenizer_config.json, uses bos/eos_token
        assert text == ("<s>[INST] Bonjour, ça va ? 😀 [/INST] Très bien, merci.</s>[INST] 日本の首都は？ [/INST]")
    else:  # template in chat_template.jinja
        assert text.endswith("<|user|>\n日本の首都は？</s>\n<|assistant|>\n")
        no_prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=False)
        assert not no_prompt.endswith("<|assistant|>\n")


def test_chat_template_raise_exception_is_a_value_error():
    tok = Tokenizer.from_files(tokenizer_files("sentencepiece"))
    with pytest.raises(ValueError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "assistant", "content": "first"}])


def test_no_chat_template_is_a_clear_error():
    files = tokenizer_files("byte_level")
    del files["chat_template.jinja"]
    tok = Tokenizer.from_files(files)
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_files({"tokenizer_config.json": b"{}"})


def with_config(kind, **changes):
    files = tokenizer_files(kind)
    config = json.loads(files["tokenizer_config.json"])
    config.update(changes)
    files["tokenizer_config.json"] = json.dumps(config).encode()
    files.pop("chat_template.jinja", None)
    return files


def test_config_variants():
    # AddedToken-style token entries; named templates; eos ids from generation_config.json.
    files = with_config(
        "byte_level",
        bos_token={"content": "<s>", "special": True},
        chat_template=[
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "{{ messages | tojson }}|{{ bos_token }}"},
        ],
    )
    files["generation_config.json"] = json.dumps({"eos_token_id": [2, 0]}).encode()
    tok = Tokenizer.from_files(files)
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == (2, 0)
    rendered = tok.apply_chat_template([{"role": "user", "content": "é"}])
    assert rendered == '[{"role": "user", "content": "é"}]|<s>'


def test_add_bos_token_false_wins_over_the_post_processor():
    tok = Tokenizer.from_files(with_config("sentencepiece", add_bos_token=False))
    assert tok.encode("Hello") == tok.encode("Hello", add_special_tokens=False)
    tok = Tokenizer.from_files(with_config("sentencepiece", add_eos_token=True))
    assert tok.encode("Hello")[-1] == tok.eos_token_ids[0]


def test_template_helpers_and_sandbox():
    template = (
        "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}"
        "{% if loop.index == 1 %}{% break %}{% endif %}{% endfor %}"
        "|{{ strftime_now('%Y') | length }}|{{ tools | length }}"
    )
    tok = Tokenizer.from_files(with_config("byte_level", chat_template=template))
    assert tok.apply_chat_template(MESSAGES, tools=[{"name": "f"}]) == "Bonjour, ça va ? 😀|4|1"

    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = Tokenizer.from_files(with_config("byte_level", chat_template=evil))
    with pytest.raises(ValueError):
        tok.apply_chat_template(MESSAGES)
    tok = Tokenizer.from_files(with_config("byte_level", chat_template="{% if %}"))
    with pytest.raises(ValueError, match="does not compile"):
        tok.apply_chat_template(MESSAGES)


def test_same_as_transformers(tok, tok_dir):
    """encode, decode and the chat template agree with transformers on the same files."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    # PreTrainedTokenizerFast rather than AutoTokenizer, which imports torch (seconds).
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    for text in CORPUS + ["", " leading space", "trailing \n", "<s>inline special</s>"]:
        ids = tok.encode(text)
        assert ids == hf(text)["input_ids"], text
        plain = hf(text, add_special_tokens=False)["input_ids"]
        assert tok.encode(text, add_special_tokens=False) == plain
        for skip in (True, False):
            assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)
    for gen in (True, False):
        expected = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        assert tok.apply_chat_template(MESSAGES, add_generation_prompt=gen) == expected
    assert tok.all_special_ids == set(hf.all_special_ids)
