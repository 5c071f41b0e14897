"""Completions ``echo`` with ``logprobs``: the prompt's own logprobs before the output's.

    text            "The cat sat" + output text
    tokens          ["The", " cat", " sat",  g0 ...]    the prompt's tokens, then the generated ones
    token_logprobs  [null,  -3.1,   -2.2,    ...]       the first prompt token has no context, so no
    top_logprobs    [null,  {..},   {..},    ...]       logprob (OpenAI's legacy completions, vLLM)
    text_offset     [0,     3,      7,       11 ...]    where each token starts in ``text``

An evaluation harness (lm-evaluation-harness ``local-completions``) sends a context and a
continuation as one prompt with ``echo``, ``logprobs`` and ``max_tokens`` 1 (or 0) and sums
the continuation's ``token_logprobs``: they are the engine's prompt logprobs, computed for
every prompt position the request asks for (chunk by chunk under chunked prefill, and
never served from the prefix cache, which holds K/V but no logits).

``max_tokens: 0`` with ``echo`` answers the prompt alone, as vLLM does: the engine
generates one token (it cannot run for none), which the answer leaves out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from frontend_svc.text.detokenizer import IncrementalDetokenizer
from frontend_svc.text.output_processor import LogprobText
from frontend_svc.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class EchoPrompt:
    """The echoed prompt's tokens as the completions logprobs shape shows them."""

    first_token: str  # the first prompt token's text (it has no logprob)
    offsets: list[int]  # text_offset of each prompt token in the echoed text


@dataclass(frozen=True)
class Echo:
    """A completions choice's echo: its prompt's text ("" without ``echo``) and, with
    ``logprobs``, where its tokens lie in that text."""

    text: str = ""
    prompt: EchoPrompt | None = None


def echo_prompt(text: str, token_ids: Sequence[int], tokenizer: Tokenizer, skip_special_tokens: bool) -> EchoPrompt:
    """``text``: the prompt as echoed (a text prompt as sent: ``skip_special_tokens``, since
    a BOS the tokenizer added is not in it; token ids decoded with their special tokens).

    A token's offset is the length of the text its predecessors decode to, so offsets are
    positions in ``text`` even where one token's text depends on its neighbours (byte-level
    pieces of one character: the character starts at its first piece's successor's offset).
    """
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens)
    offsets, pos = [], 0
    for t in token_ids:
        offsets.append(min(pos, len(text)))
        pos += len(detok.push([t]))
    first = tokenizer.decode(list(token_ids[:1]), skip_special_tokens=False) if token_ids else ""
    return EchoPrompt(first, offsets)


def completion_top(lp: LogprobText, num_top: int | None, value) -> dict[str, float]:
    """A token's ``top_logprobs`` entry: the token itself, then up to ``num_top`` best
    alternatives (None: all the engine sent). The token comes first, so ``logprobs: 0`` still
    names it, as vLLM does; when it is one of the best it appears once."""
    top = lp.top if num_top is None else lp.top[:num_top]
    out = {lp.token: value(lp.logprob)}
    out.update((t.token, value(t.logprob)) for t in top)
    return out


def echo_logprobs(echo: EchoPrompt, prompt_lps: list[LogprobText], num_top: int | None, value) -> dict:
    """The prompt's part of a completions ``logprobs``: ``prompt_lps`` are the engine's
    prompt logprobs (one per prompt token after the first)."""
    return {
        "tokens": [echo.first_token, *(lp.token for lp in prompt_lps)],
        "token_logprobs": [None, *(value(lp.logprob) for lp in prompt_lps)],
        "top_logprobs": [None, *(completion_top(lp, num_top, value) for lp in prompt_lps)],
        "text_offset": echo.offsets[: 1 + len(prompt_lps)],
    }
