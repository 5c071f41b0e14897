"""Text <-> token ids for the frontend, loaded from a Hugging Face tokenizer directory.

Files read (only ``tokenizer.json`` is required):

    tokenizer.json            the fast tokenizer: normalizer, model, decoder, post-processor
    tokenizer_config.json     bos/eos tokens, add_bos_token/add_eos_token, chat_template
    special_tokens_map.json   bos/eos tokens when tokenizer_config.json does not name them
    chat_template.jinja       chat template (wins over the other two sources)
    chat_template.json        {"chat_template": ...} (older transformers releases)
    generation_config.json    extra eos_token_id values (Llama-3 lists several)

Why `tokenizers` + jinja2 rather than transformers' ``PreTrainedTokenizerFast``: on the
2-core dev machine ``import transformers`` alone takes ~2.9 s against ~0.3 s for
``import tokenizers, jinja2``, and the transformers wrapper adds Python overhead on every
decode, which the streaming path calls twice per output token. The behaviour the
frontend needs (encode with the post-processor, decode, a sandboxed chat template) is
small enough to own here; tests/frontend/test_tokenizer.py checks it against
transformers on the same files.

Decoding is the raw ``tokenizers`` decode: ``clean_up_tokenization_spaces`` is ignored on
purpose, because that clean-up rewrites text already streamed (" ." -> ".") and so could
never match what the incremental detokenizer sends.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jinja2
import tokenizers

from frontend_svc.text.chat_template.sandbox import ChatSandbox, template_variables
from tandem_common.tokenizer_files import TOKENIZER_FILE_NAMES

# From this many characters (or ids) on, encode and decode go through the batch calls of
# `tokenizers`, which release the GIL (the single calls hold it): a long input tokenized
# on a worker thread then leaves the event loop free. Shorter ones keep the cheaper call.
_LONG_INPUT = 4096


class Tokenizer:
    """A fast tokenizer plus the bits of tokenizer_config.json that serving needs."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: Mapping[str, Any] | None = None,
        special_tokens_map: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        generation_config: Mapping[str, Any] | None = None,
        chat_template_file: str = "the chat template",
    ) -> None:
        config = dict(config or {})
        special_tokens_map = dict(special_tokens_map or {})
        self.backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

        def token(name: str) -> str | None:
            return _token_content(config.get(name)) or _token_content(special_tokens_map.get(name))

        self.bos_token = token("bos_token")
        self.eos_token = token("eos_token")
        self.unk_token = token("unk_token")
        self.pad_token = token("pad_token")
        self.bos_token_id: int | None = self._id_of(self.bos_token)

        eos_ids: list[int] = []
        eos_id = self._id_of(self.eos_token)
        if eos_id is not None:
            eos_ids.append(eos_id)
        extra = (generation_config or {}).get("eos_token_id")
        for i in [extra] if isinstance(extra, int) else (extra or []):
            if isinstance(i, int) and i not in eos_ids:
                eos_ids.append(i)
        self.eos_token_ids: tuple[int, ...] = tuple(eos_ids)

        # "Special" as `tokenizers` means it: added tokens flagged special, which are the
        # ones decode(skip_special_tokens=True) drops.
        added = backend.get_added_tokens_decoder()
        self.all_special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self.special_tokens: frozenset[str] = frozenset(t.content for t in added.values() if t.special)
        self.byte_fallback_bytes: dict[int, int] = _byte_fallback_bytes(backend)

        # Explicit add_bos_token/add_eos_token win over the post-processor, as in
        # transformers' Llama/Gemma tokenizers, which rebuild their post-processor from them.
        self._add_bos: bool | None = config.get("add_bos_token")
        self._add_eos: bool | None = config.get("add_eos_token")

        self._chat_template_source = chat_template
        self.chat_template_file = chat_template_file  # which tokenizer file held it, for messages
        self._compiled_template: jinja2.Template | None = None

        # Characters of the longest vocabulary entry, added tokens included: no token stands
        # for more characters of normalized text (a byte-level entry has one character per
        # byte of text, a SentencePiece byte token "<0xNN>" six for one byte).
        self.max_token_chars: int = max((len(t) for t in backend.get_vocab(with_added_tokens=True)), default=1)

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        files: dict[str, bytes] = {}
        for name in TOKENIZER_FILE_NAMES:
            full = os.path.join(path, name)
            if os.path.isfile(full):
                with open(full, "rb") as f:
                    files[name] = f.read()
        if "tokenizer.json" not in files:
            raise ValueError(
                f"{os.fspath(path)!r} has no tokenizer.json; only fast (tokenizers) "
                "tokenizers are supported: save one with transformers' save_pretrained()"
            )
        return cls.from_files(files)

    @classmethod
    def from_files(cls, files: Mapping[str, bytes]) -> Tokenizer:
        """Builds from file contents keyed by file name (as fetched from an engine)."""
        if "tokenizer.json" not in files:
            raise ValueError("tokenizer files must include tokenizer.json")
        backend = tokenizers.Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
        config = _json_file(files, "tokenizer_config.json")
        special_tokens_map = _json_file(files, "special_tokens_map.json")
        generation_config = _json_file(files, "generation_config.json")

        template: Any = None
        if "chat_template.jinja" in files:
            template, origin = files["chat_template.jinja"].decode("utf-8"), "chat_template.jinja"
        elif "chat_template.json" in files:
            template, origin = _json_file(files, "chat_template.json").get("chat_template"), "chat_template.json"
        else:
            template, origin = config.get("chat_template"), "tokenizer_config.json"
        return cls(backend, config, special_tokens_map, _pick_template(template), generation_config, origin)

    # ------------------------------------------------------------------ ids <-> text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Text from a chat template already carries its BOS:
        encode it with ``add_special_tokens=False``."""
        if not add_special_tokens or (self._add_bos is None and self._add_eos is None):
            return self._encode(text, add_special_tokens)
        ids = self._encode(text, False)
        if self._add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        if self._add_eos and self.eos_token_ids:
            ids.append(self.eos_token_ids[0])
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; raises ValueError for ids outside the vocabulary."""
        ids = list(token_ids)
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        if len(ids) >= _LONG_INPUT:
            return self.backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) >= _LONG_INPUT:
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def normalized_len(self, text: str) -> int:
        """Length of ``text`` after the tokenizer's normalizer (e.g. NFC), which runs before
        the text is cut into tokens."""
        normalizer = self.backend.normalizer
        return len(text) if normalizer is None else len(normalizer.normalize_str(text))

    # ------------------------------------------------------------------ chat

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template_source is not None

    @property
    def chat_template(self) -> str | None:
        """The chat template's source (the tool-call format is read from it)."""
        return self._chat_template_source

    def special_token_id(self, text: str) -> int | None:
        """The id of the special token whose text is ``text``, or None."""
        return self._id_of(text) if text in self.special_tokens else None

    @property
    def template_specials(self) -> dict[str, str]:
        """The special tokens a chat template sees as variables (bos_token ...)."""
        return {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "unk_token": self.unk_token or "",
            "pad_token": self.pad_token or "",
        }

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Renders ``messages`` with the model's chat template in this process (a sandboxed
        jinja2 environment set up like transformers', chat_template/sandbox.py). Extra
        keyword arguments (``tools``, ``enable_thinking`` ...) become template variables.
        Any failure, including the template's own ``raise_exception``, is a ValueError.

        No time budget here: the server renders through chat_template.TemplateRenderer,
        in processes it can stop."""
        if self._chat_template_source is None:
            raise ValueError("this model's tokenizer has no chat template; send a text prompt instead")
        if self._compiled_template is None:
            try:
                self._compiled_template = _sandbox().from_string(self._chat_template_source)
            except (jinja2.TemplateError, RecursionError) as e:
                raise ValueError(f"the model's chat template does not compile: {e}") from e
        variables = template_variables(self.template_specials, messages, add_generation_prompt, template_kwargs)
        try:
            return self._compiled_template.render(**variables)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e
        except RecursionError as e:
            raise ValueError(f"the chat template recursed too deep on these messages: {e}") from e
        except (TypeError, KeyError, AttributeError, IndexError) as e:
            raise ValueError(f"chat template could not render these messages: {e!r}") from e


# ---------------------------------------------------------------------- helpers


def _json_file(files: Mapping[str, bytes], name: str) -> dict[str, Any]:
    if name not in files:
        return {}
    try:
        value = json.loads(files[name].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{name} is not valid JSON: {e}") from e
    return value if isinstance(value, dict) else {}


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json spells tokens as a string or as a serialised AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(template: Any) -> str | None:
    """A template is a string, or a list of {"name", "template"} of which "default" is used."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _byte_fallback_bytes(backend: tokenizers.Tokenizer) -> dict[int, int]:
    """Token id -> byte value of the ``<0xNN>`` tokens when the decoder has a ByteFallback
    stage, else empty.

    The detokenizer needs them: ByteFallback turns a whole run of byte tokens into U+FFFD
    when the run is not valid UTF-8, so text from an unfinished run may still change."""
    decoder = backend.decoder
    if decoder is None or "ByteFallback" not in _decoder_types(json.loads(decoder.__getstate__())):
        return {}
    ids = {b: backend.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    return {i: b for b, i in ids.items() if i is not None}


def _decoder_types(node: Any) -> Iterable[str]:
    if isinstance(node, dict):
        if isinstance(node.get("type"), str):
            yield node["type"]
        for child in node.get("decoders") or ():
            yield from _decoder_types(child)


_SANDBOX: ChatSandbox | None = None


def _sandbox() -> ChatSandbox:
    global _SANDBOX
    if _SANDBOX is None:
        _SANDBOX = ChatSandbox()
    return _SANDBOX
