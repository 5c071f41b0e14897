"""Real weights: SmolLM2-135M-Instruct (Q4_1 GGUF) served by Tandem against ``transformers``.

Both read the same GGUF file: Tandem through ``--model FILE.gguf`` (dequantized at load,
float32), transformers through ``from_pretrained(gguf_file=...)`` (its own dequantization,
float32). Greedy token ids of 12 prompts (6 chat turns rendered with the GGUF's chat
template, 6 raw texts) must be equal, up to near ties as in test_engine_vs_transformers.py;
the tokenizer the engine serves to frontends must map every id of the GGUF's vocabulary as
transformers' converted tokenizer does. One engine serves every prompt in one batch, so the
module costs a few seconds of model time on a 2-core CPU.
"""

from __future__ import annotations

import pytest
import torch

from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.model.load.gguf_checkpoint import resolve_model_dir
from engine_svc.model.load.gguf_metadata import field_value, open_gguf
from engine_svc.types import SamplingParams
from frontend_svc.text.tokenizer import Tokenizer

NUM_NEW = 12
TIE_EPS = 1e-4
CHAT_TURNS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "Write a haiku about the sea.",
    "What is 12 plus 7?",
    "Give me one tip for better sleep.",
]
RAW_TEXTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three states of matter are",
    "Paris is the capital of",
    "1, 2, 3, 4,",
]


@pytest.fixture(scope="module")
def hf(smollm2_gguf):
    import transformers

    kw = dict(gguf_file=smollm2_gguf.name, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), dtype=torch.float32, **kw)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def engine(smollm2_gguf):
    return EngineCore(
        EngineConfig(model=str(smollm2_gguf), dtype="float32", num_kv_blocks=128, block_size=16, max_num_seqs=16)
    )


def _prompts(tokenizer) -> list[list[int]]:
    chats = [
        tokenizer.apply_chat_template([{"role": "user", "content": turn}], add_generation_prompt=True, tokenize=True)
        for turn in CHAT_TURNS
    ]
    chats = [list(c["input_ids"]) if hasattr(c, "keys") else list(c) for c in chats]
    return chats + [tokenizer(text).input_ids for text in RAW_TEXTS]


def _hf_greedy(model, prompt: list[int], eos_token_ids: tuple[int, ...]) -> list[int]:
    """Up to NUM_NEW greedy ids, ending at the first EOS like the engine's (transformers'
    min_new_tokens would mask EOS instead, so both stop at it)."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NUM_NEW,
            do_sample=False,
            eos_token_id=list(eos_token_ids),
            pad_token_id=eos_token_ids[0],
        )
    return out[0, len(prompt) :].tolist()


def test_greedy_ids_equal_transformers_on_the_same_gguf(engine, hf):
    model, tokenizer = hf
    prompts = _prompts(tokenizer)
    assert len(prompts) == 12
    completions = engine.generate(prompts, SamplingParams(max_tokens=NUM_NEW, temperature=0.0))
    for prompt, completion in zip(prompts, completions):
        ours, theirs = completion.output_token_ids, _hf_greedy(model, prompt, engine.eos_token_ids)
        if ours == theirs:
            continue
        i = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + theirs[:i]])).logits[0, -1]
        top2 = torch.topk(logits, 2).values
        gap = (top2[0] - top2[1]).item()
        assert gap < TIE_EPS, f"diverged at output {i} (top-2 gap {gap:.2e}): {ours} vs {theirs}"
    # A sensible answer, not merely equal noise.
    answer = tokenizer.decode(completions[0].output_token_ids, skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_the_engine_reads_the_gguf_metadata(engine, smollm2_gguf):
    assert engine.model_name == "SmolLM2-135M-Instruct.Q4_1"
    assert engine.vocab_size == 49152 and engine.max_model_len == 8192
    assert engine.eos_token_ids == (2,)  # <|im_end|>: ends a chat turn
    args = engine.runner.model_args
    assert (args.num_layers, args.hidden_size, args.num_heads, args.num_kv_heads) == (30, 576, 9, 3)
    assert args.tie_word_embeddings and args.rope_theta == 100000.0
    # Tied in the file, held once: the embedding reads its rows from the head's panels.
    model = engine.runner.model
    assert model.embed_tokens.weight_q is model.lm_head.weight_p


def test_the_served_tokenizer_round_trips_the_gguf_vocabulary(smollm2_gguf, hf):
    _, theirs = hf
    served_dir, _ = resolve_model_dir(smollm2_gguf)
    ours = Tokenizer.from_dir(served_dir)
    tokens = field_value(open_gguf(smollm2_gguf), "tokenizer.ggml.tokens")
    assert ours.vocab_size == len(tokens) == len(theirs)
    ids = list(range(len(tokens)))
    assert [ours.backend.id_to_token(i) for i in ids] == tokens
    assert [ours.backend.id_to_token(i) for i in ids] == theirs.convert_ids_to_tokens(ids)
    # Every token alone decodes to the same text, special tokens included.
    assert ours.backend.decode_batch([[i] for i in ids], skip_special_tokens=False) == theirs.batch_decode(
        [[i] for i in ids], skip_special_tokens=False
    )
    samples = [
        "<|im_start|>user\nHello, world!<|im_end|>\n<|im_start|>assistant\n",
        "  leading spaces, tabs\tand unicode: naïve café 東京 🚀",
        "<|endoftext|>def f(x):\n    return x ** 2\n",
    ]
    for text in samples:
        assert ours.encode(text) == theirs(text).input_ids, text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    chat = [{"role": "user", "content": CHAT_TURNS[0]}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == theirs.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=False
    )
