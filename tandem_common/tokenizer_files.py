"""The tokenizer files of a model directory: which the engine hands out (GetTokenizer) and
which of them a frontend reads. One definition, so the two services never disagree on
what "the same tokenizer" means (a frontend compares engines by the digests of the
files it reads)."""

from __future__ import annotations

# What a frontend reads: the fast tokenizer, its configuration, the chat template (either
# form) and the generation defaults (eos ids).
TOKENIZER_FILE_NAMES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)

# Slow-tokenizer files: served too, for clients that load a tokenizer with transformers;
# a frontend never reads them, so they take no part in its comparison of engines.
SLOW_TOKENIZER_FILE_NAMES = ("tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")

# What the engine hands out, whichever of these its model directory has.
SERVED_TOKENIZER_FILE_NAMES = TOKENIZER_FILE_NAMES + SLOW_TOKENIZER_FILE_NAMES
