"""Token-id deltas -> text deltas, one detokenizer per output sequence.

Algorithm (the prefix/read-offset scheme): decode a small window of recent tokens twice,
with and without the new ones, and emit only the text that the new tokens added.

    ids:  | c c c | n n | h h |     c: context (the ids of the last emitted delta,
          0       ^read ^end            or the prompt's tail at first)
                                        n: ids to emit now, h: ids held back (below)
    prefix_text = decode(ids[:read])
    text        = decode(ids[:end])
    delta       = text[len(prefix_text):]      then ids <- ids[read:], so n becomes c

The context is what lets a SentencePiece token keep its leading space ("▁world" decodes
to "world" alone, " world" after another token) and lets a byte-level token complete a
character whose first bytes came earlier.

Text is held back, and emitted by a later push or by ``flush()``, when
  * it ends in U+FFFD: the last character's bytes may be incomplete (byte-level BPE);
  * it comes from a trailing run of ``<0xNN>`` tokens of a ByteFallback decoder: that
    decoder renders a run that is not valid UTF-8 as one U+FFFD per byte, so a later
    byte token can change text that earlier bytes produced (é + stray byte -> "���").
    A run is final once any other token follows it.

Reference matched (tests/frontend/test_detokenizer.py checks it with random text, random
ids and random chunkings):

    seed = seed_token_ids(tokenizer, prompt_token_ids, skip_special_tokens)
           (the last SEED_TOKENS prompt ids that a decode keeps; see its docstring)
    det.seed_text + "".join(deltas) + det.flush() == tokenizer.decode(seed + output_ids)

``seed_text`` is ``decode(seed)`` cut back to its last character boundary, which for a
prompt that was text is all of it. So the output text is what a decode of prompt +
output shows after the prompt:
  * byte-level BPE: exactly ``decode(output_ids)`` (when the prompt ends on a character
    boundary; otherwise the output's text starts with the character it completes);
  * SentencePiece (Metaspace "▁" / Strip decoders): ``decode(output_ids)`` except that
    the first output token keeps its leading space (" Paris" after "The capital of France
    is"), which ``decode(output_ids)`` strips because there the token comes first;
  * no prompt, or a prompt of skipped special tokens only: ``decode(output_ids)``.
The one case no stream can follow: with ByteFallback, a prompt that ends inside a
character (token-id prompts only) or whose seed is byte tokens alone, followed by output
bytes that make the joint run invalid UTF-8; the decoder then re-renders prompt text,
and the output's new ids are decoded on their own.

Why not ``tokenizers.decoders.DecodeStream`` (the same window idea, in Rust: ~2 µs per
token against ~4-7 µs here, both far inside the frontend's 100 µs per token): it cannot
release held-back text at the end of a stream (a stream ending in an unfinished
character loses it), and it emits a ByteFallback run early and then raises "Invalid
prefix encountered" when a later byte re-renders it.
"""

from __future__ import annotations

from collections.abc import Sequence

from frontend_svc.text.tokenizer import Tokenizer

# Prompt tokens that seed the context window: enough for any decoder here (one token
# suffices for SentencePiece spaces); more only makes the first decode longer.
SEED_TOKENS = 6

_REPLACEMENT_CHAR = "\ufffd"
# How far back seed_token_ids looks past a trailing run of byte tokens.
_MAX_BYTE_RUN = 64


def seed_token_ids(tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool) -> list[int]:
    """The prompt tail that seeds the context window.

    Its last SEED_TOKENS ids, leaving out ids a decode drops (special ones when skipped,
    ids outside the vocabulary). For a ByteFallback decoder, which renders a whole run of
    ``<0xNN>`` tokens as U+FFFD when the run is not valid UTF-8, two adjustments keep
    prompt text from changing under the output:
      * a trailing run of byte tokens that is complete UTF-8 is left out (its text is
        final; kept, the output's first bytes would join the run);
      * the seed does not start on a UTF-8 continuation byte.
    """
    dropped = tokenizer.all_special_ids if skip_special_tokens else frozenset()
    byte_values = tokenizer.byte_fallback_bytes
    limit = SEED_TOKENS + (_MAX_BYTE_RUN if byte_values else 0)
    tail: list[int] = []
    for tid in reversed(prompt_token_ids):
        if 0 <= tid < tokenizer.vocab_size and tid not in dropped:
            tail.append(tid)
            if len(tail) == limit:
                break
    tail.reverse()

    end = len(tail)
    if byte_values:
        run_start = end
        while run_start > 0 and tail[run_start - 1] in byte_values:
            run_start -= 1
        run = bytes(byte_values[t] for t in tail[run_start:])
        if 0 < run_start < end and _is_complete_utf8(run):
            end = run_start
    begin = max(0, end - SEED_TOKENS)
    while begin > 0 and 0x80 <= byte_values.get(tail[begin], 0) <= 0xBF:
        begin -= 1
    return tail[begin:end]


def _is_complete_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class IncrementalDetokenizer:
    """Turns one sequence's token ids into text deltas; see the module docstring."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._decode = tokenizer.backend.decode
        self._skip = skip_special_tokens
        self._vocab_size = tokenizer.vocab_size
        # With skip_special_tokens, special ids contribute nothing to any decode (tokenizers
        # drops them before its decoder runs), so they never enter the window at all.
        self._dropped = tokenizer.all_special_ids if skip_special_tokens else frozenset()
        self._byte_ids = tokenizer.byte_fallback_bytes

        # _ids[:_read] is the context (its text is _prefix_text, already emitted or part
        # of the prompt); _ids[_read:] is not emitted yet.
        seed = seed_token_ids(tokenizer, prompt_token_ids, skip_special_tokens)
        self._ids = seed
        # The seed counts as emitted up to its last character boundary: ids past it (a
        # character the prompt left unfinished) are completed and emitted by the output.
        read, text = len(seed), ""
        while read > 0:
            text = self._decode(seed[:read], skip_special_tokens=self._skip)
            if not text.endswith(_REPLACEMENT_CHAR):
                break
            read, text = read - 1, ""
        self._read = read
        self._prefix_text = text
        # The reference for the output: a full decode of seed + output shows it after this.
        self.seed_text = text

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Adds the sequence's next token ids; returns the text they complete (maybe "")."""
        new_ids = [t for t in new_token_ids if 0 <= t < self._vocab_size and t not in self._dropped]
        if not new_ids:
            # Also ids outside the vocabulary: tokenizers' decode drops them too.
            return ""
        ids = self._ids
        ids.extend(new_ids)
        end = len(ids)
        if self._byte_ids:
            while end > self._read and ids[end - 1] in self._byte_ids:
                end -= 1
        if end == self._read:
            return ""
        return self._emit(end, hold_incomplete=True)

    def flush(self) -> str:
        """At the end of the stream: the held-back text, exactly as a full decode shows it."""
        if self._read == len(self._ids):
            return ""
        return self._emit(len(self._ids), hold_incomplete=False)

    def _emit(self, end: int, hold_incomplete: bool) -> str:
        """Emits the text that ``ids[read:end]`` add; they become the new context."""
        ids = self._ids
        text = self._decode(ids[:end], skip_special_tokens=self._skip)
        if hold_incomplete and (len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT_CHAR)):
            return ""
        if text.startswith(self._prefix_text):
            delta = text[len(self._prefix_text) :]
        else:
            # The decoder re-rendered context text. Only ByteFallback does, when a seed
            # that ends inside a character (or is byte tokens alone) and the output's first
            # bytes make one run that is not UTF-8. No stream can follow that: the new ids
            # are decoded on their own.
            delta = self._decode(ids[self._read : end], skip_special_tokens=self._skip)

        del ids[: self._read]
        self._read = end - self._read
        self._prefix_text = self._decode(ids[: self._read], skip_special_tokens=self._skip)
        return delta
