"""Tiny tokenizers trained in code and saved as Hugging Face tokenizer directories.

Two families, as real models ship them:

* ``byte_level``:  GPT-2 / Llama-3 style byte-level BPE (ByteLevel pre-tokenizer and
  decoder, "<s> $A" post-processor). Chat template in ``chat_template.jinja``.
* ``sentencepiece``: Llama-2 / Mistral style BPE with byte fallback ("▁" for spaces,
  decoder Replace + ByteFallback + Fuse + Strip, ``<0xNN>`` tokens for characters not in
  the vocabulary, add_bos_token in tokenizer_config.json). Chat template inside
  tokenizer_config.json.

Both know ``<unk>``, ``<s>``, ``</s>`` as special tokens. The corpus has accents, CJK and
emoji; characters seen only once are left out of the sentencepiece alphabet, so they fall back
to bytes.

    path = save_tokenizer_dir(tmp_path, "sentencepiece")
    tok = frontend_svc.text.tokenizer.Tokenizer.from_dir(path)
"""

from __future__ import annotations

import collections
import functools
import json
import os
from pathlib import Path

from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

KINDS = ("byte_level", "sentencepiece")
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello again, world. How are you today?",
    "The capital of France is Paris, and the capital of Japan is Tokyo.",
    "Serving large language models needs a scheduler and a paged KV cache.",
    "Café crème, naïve façade, déjà vu, jalapeño, Ångström, über, smörgåsbord.",
    "Ça va très bien, merci ! Où est la gare ? L'été à Montréal.",
    "日本語のテキストです。東京は日本の首都です。",
    "中文文本：北京是中国的首都。你好，世界！",
    "한국어 문장도 조금 있습니다. 안녕하세요.",
    "Emoji time 😀😃😄 🚀 rocket, 👍🏽 thumbs, 🇫🇷 flag, ❤️ heart, 👨‍👩‍👧 family.",
    "Numbers 0123456789 and symbols: #$%&*()[]{}<>/\\|~^_=+-.",
    "Tabs\tand\nnewlines\n\nand   multiple   spaces.",
    "def main():\n    print('hello, world')\n    return 0\n",
    "Ελληνικά κείμενα, русский текст, עברית, العربية.",
]

BYTE_LEVEL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] | trim + '</s>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

SENTENCEPIECE_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
)


def _corpus() -> list[str]:
    return CORPUS * 3


@functools.cache
def _byte_level_json() -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok.to_str()


@functools.cache
def _sentencepiece_json() -> str:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    # Characters seen once in the corpus are left out of the alphabet, so they fall back to
    # byte tokens. (Chosen here rather than with the trainer's limit_alphabet, which breaks
    # frequency ties differently from one process to the next.)
    counts = collections.Counter("".join(CORPUS))
    corpus = ["".join(c if counts[c] > 1 else " " for c in line) for line in _corpus()]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS, show_progress=False)
    tok.train_from_iterator(corpus, trainer)

    # Llama-2 layout: "▁"-normalizer instead of a pre-tokenizer, byte tokens in the vocab
    # (ordinary tokens, not special ones), and the byte-fallback decoder chain.
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(data))
    tok.pre_tokenizer = None
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok.to_str()


def train_tokenizer(kind: str) -> Tokenizer:
    """A fresh `tokenizers.Tokenizer` of the given kind (training is cached)."""
    if kind == "byte_level":
        return Tokenizer.from_str(_byte_level_json())
    if kind == "sentencepiece":
        return Tokenizer.from_str(_sentencepiece_json())
    raise ValueError(f"unknown tokenizer kind {kind!r}; expected one of {KINDS}")


def tokenizer_files(kind: str) -> dict[str, bytes]:
    """The files of a Hugging Face tokenizer directory for ``kind``, by file name."""
    tok = train_tokenizer(kind)
    config: dict = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": 2048,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t in SPECIAL_TOKENS
            for i in [tok.token_to_id(t)]
        },
    }
    files = {"tokenizer.json": tok.to_str().encode()}
    if kind == "sentencepiece":
        config["add_bos_token"] = True
        config["add_eos_token"] = False
        config["chat_template"] = SENTENCEPIECE_CHAT_TEMPLATE
    else:
        files["chat_template.jinja"] = BYTE_LEVEL_CHAT_TEMPLATE.encode()
    files["tokenizer_config.json"] = json.dumps(config, ensure_ascii=False, indent=2).encode()
    files["special_tokens_map.json"] = json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    ).encode()
    return files


def save_tokenizer_dir(parent: str | os.PathLike[str], kind: str) -> Path:
    """Writes ``kind``'s tokenizer files into ``parent/kind`` and returns that folder."""
    path = Path(parent) / kind
    path.mkdir(parents=True, exist_ok=True)
    for name, data in tokenizer_files(kind).items():
        (path / name).write_bytes(data)
    return path
