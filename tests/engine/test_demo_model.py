"""The built-in demo model: shape, determinism, tokenizer, loading, and the shared cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from engine_svc import demo_model
from engine_svc.demo_model import (
    BOS_TOKEN,
    EOS_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
    build_demo_model,
    default_demo_model_dir,
    ensure_demo_model,
    is_demo_model_dir,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
TRICKY_TEXT = "Crème brûlée in Zürich, São Paulo & Łódź — 日本語の天気は雨 🌱🚂🍞 👍🏽 ¿Qué tal?\n\tend"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("demo") / "model")


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _assert_same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


# ------------------------------------------------------------------------------ config


def test_config_is_a_small_untied_llama_with_a_large_init(model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "llama"
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.initializer_range >= 0.1
    assert config.tie_word_embeddings is False
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (256, 4, 768)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.max_position_embeddings == 2048
    raw = _read_json(model_dir / "config.json")
    assert raw["rope_theta"] == raw["rope_parameters"]["rope_theta"] == 10000.0
    assert raw["torch_dtype"] == "float32"


def test_vocab_and_special_ids_agree_between_model_and_tokenizer(model_dir, hf_tokenizer):
    config = _read_json(model_dir / "config.json")
    generation = _read_json(model_dir / "generation_config.json")
    assert config["vocab_size"] == len(hf_tokenizer) == 2048
    assert config["vocab_size"] % 64 == 0
    eos_id = hf_tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    bos_id = hf_tokenizer.convert_tokens_to_ids(BOS_TOKEN)
    assert hf_tokenizer.eos_token_id == config["eos_token_id"] == eos_id
    assert hf_tokenizer.bos_token_id == config["bos_token_id"] == generation["bos_token_id"] == bos_id
    im_end_id = hf_tokenizer.convert_tokens_to_ids(IM_END_TOKEN)
    assert generation["eos_token_id"] == [eos_id, im_end_id]
    # Specials sit at the top of the vocabulary, after every trained token.
    specials = [BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN]
    assert hf_tokenizer.convert_tokens_to_ids(specials) == [2044, 2045, 2046, 2047]


# ------------------------------------------------------------------------- determinism


def test_building_twice_gives_identical_bytes(model_dir, tmp_path):
    again = build_demo_model(tmp_path / "again")
    _assert_same_files(model_dir, again)


def test_build_leaves_the_global_rng_alone(tmp_path):
    torch.manual_seed(7)
    state = torch.get_rng_state()
    build_demo_model(tmp_path / "m")
    assert torch.equal(torch.get_rng_state(), state)


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_accents_cjk_and_emoji(model_dir, hf_tokenizer):
    from tokenizers import Tokenizer

    ids = hf_tokenizer(TRICKY_TEXT).input_ids
    assert ids[0] == hf_tokenizer.bos_token_id and ids.count(hf_tokenizer.bos_token_id) == 1
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == TRICKY_TEXT
    assert hf_tokenizer.decode(ids) == BOS_TOKEN + TRICKY_TEXT

    # The bare tokenizers library (what a frontend may use) agrees with transformers.
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert raw.encode(TRICKY_TEXT).ids == ids
    assert raw.encode(TRICKY_TEXT, add_special_tokens=False).ids == ids[1:]
    assert raw.decode(ids) == TRICKY_TEXT


def test_tokenizer_compresses_the_corpus_and_keeps_specials_whole(hf_tokenizer):
    text = "The garden is quiet after the rain, and the train leaves at seven."
    ids = hf_tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) < len(text) / 3  # real merges were learned
    marked = f"{IM_START_TOKEN}user\nhi{IM_END_TOKEN}{EOS_TOKEN}"
    ids = hf_tokenizer(marked, add_special_tokens=False).input_ids
    assert hf_tokenizer.convert_tokens_to_ids(IM_START_TOKEN) == ids[0]
    assert ids[-2:] == hf_tokenizer.convert_tokens_to_ids([IM_END_TOKEN, EOS_TOKEN])


def test_chat_template_renders_chatml(model_dir, hf_tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Will it rain? ☔"},
    ]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWill it rain? ☔<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = hf_tokenizer.apply_chat_template(messages, tokenize=False)
    assert no_prompt.endswith("<|im_end|>\n")
    ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids.count(hf_tokenizer.bos_token_id) == 1  # the template's BOS only
    config = _read_json(model_dir / "tokenizer_config.json")
    assert (model_dir / "chat_template.jinja").read_text(encoding="utf-8") == config["chat_template"]
    assert config["bos_token"] == BOS_TOKEN and config["eos_token"] == EOS_TOKEN


# ------------------------------------------------------------------------------- model


def test_transformers_loads_every_weight(model_dir):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert isinstance(model, LlamaForCausalLM)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert model.model.embed_tokens.weight.std().item() == pytest.approx(0.15, rel=0.05)


def test_greedy_generation_is_not_one_repeated_token(model_dir, hf_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    inputs = hf_tokenizer("The first warm morning of the year", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    new_token_ids = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(new_token_ids) == 32
    assert len(set(new_token_ids)) >= 8, new_token_ids


# ------------------------------------------------------------------------------- cache


def test_default_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("TANDEM_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_demo_model_dir() == tmp_path / "home" / ".cache" / "tandem" / "demo-model-v1"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_demo_model_dir() == tmp_path / "xdg" / "tandem" / "demo-model-v1"
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "tc"))
    assert default_demo_model_dir() == tmp_path / "tc" / "demo-model-v1"


def test_ensure_is_idempotent(cache_dir, model_dir):
    first = ensure_demo_model()
    assert first == cache_dir / "demo-model-v1" and is_demo_model_dir(first)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    assert _leftovers(cache_dir) == []
    _assert_same_files(model_dir, first)


def test_ensure_from_many_threads_at_once(cache_dir, model_dir):
    barrier = threading.Barrier(4)
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker():
        barrier.wait()
        try:
            results.append(ensure_demo_model())
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results == [cache_dir / "demo-model-v1"] * 4
    assert _leftovers(cache_dir) == []
    _assert_same_files(model_dir, results[0])


def test_ensure_from_two_processes_at_once(cache_dir, model_dir):
    """Fresh interpreters racing on one cache directory; also a cross-process byte check."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    script = (
        "from engine_svc.demo_model import ensure_demo_model, is_demo_model_dir\n"
        "path = ensure_demo_model()\n"
        "assert is_demo_model_dir(path)\n"
        "print(path)\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=240) for p in procs]
    for proc, (stdout, stderr) in zip(procs, outputs):
        assert proc.returncode == 0, stderr
        assert Path(stdout.strip()) == cache_dir / "demo-model-v1"
    assert _leftovers(cache_dir) == []
    _assert_same_files(model_dir, cache_dir / "demo-model-v1")


def test_build_refuses_a_foreign_directory_unless_forced(tmp_path):
    target = tmp_path / "busy"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        build_demo_model(target)
    assert build_demo_model(target, force=True) == target
    assert is_demo_model_dir(target) and not (target / "notes.txt").exists()
    assert _leftovers(tmp_path) == []


def test_build_into_an_empty_existing_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    assert is_demo_model_dir(build_demo_model(tmp_path / "empty"))


def test_corpus_ships_next_to_the_module():
    corpus = Path(demo_model.__file__).with_name("demo_corpus.txt")
    text = corpus.read_text(encoding="utf-8")
    assert 20_000 <= len(text.encode("utf-8")) <= 45_000
    assert "é" in text and "日本語" in text and "🌱" in text
