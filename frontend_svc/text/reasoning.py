"""Reasoning split from content: ``<think> ... </think>`` (DeepSeek-R1, Qwen3 style).

The output starts inside the thought when the rendered prompt opened it (a template that
ends the prompt with ``<think>``); otherwise a thought is recognised only at the very start
of the output (past whitespace). Everything up to ``</think>`` is reasoning, the rest is
content; a thought cut short (max_tokens) stays reasoning. Tags are held back while only
part of one has arrived, so a tag is never split across the two fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tools.scan import held_suffix

OPEN_TAG, CLOSE_TAG = "<think>", "</think>"
# The --reasoning-parser names; both write <think> ... </think>. Whether the output starts
# inside the thought is read from the prompt, never from the name.
REASONING_PARSERS = ("deepseek_r1", "qwen3")
_BEFORE, _THINKING, _AFTER = range(3)


def prompt_opens_thought(prompt: str) -> bool:
    """Whether the rendered prompt leaves the model inside a thought."""
    tail = prompt.rstrip()
    return tail.endswith(OPEN_TAG)


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    def __init__(self, starts_in_thought: bool) -> None:
        self._state = _THINKING if starts_in_thought else _BEFORE
        self._buf = ""

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        self._buf += text
        while self._buf:
            if self._state == _BEFORE:
                stripped = self._buf.lstrip()
                if stripped.startswith(OPEN_TAG):
                    self._buf = stripped[len(OPEN_TAG) :]
                    self._state = _THINKING
                elif not stripped or OPEN_TAG.startswith(stripped):
                    return out
                else:
                    self._state = _AFTER
            elif self._state == _THINKING:
                k = self._buf.find(CLOSE_TAG)
                if k < 0:
                    keep = held_suffix(self._buf, [CLOSE_TAG])
                    out.reasoning += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                out.reasoning += self._buf[:k]
                self._buf = self._buf[k + len(CLOSE_TAG) :]
                self._state = _AFTER
            else:
                out.content += self._buf
                self._buf = ""
        return out

    def finish(self) -> ReasoningDelta:
        text, self._buf = self._buf, ""
        if self._state == _THINKING:
            return ReasoningDelta(reasoning=text)
        return ReasoningDelta(content=text)


def split_reasoning(text: str, starts_in_thought: bool) -> ReasoningDelta:
    """The complete split of a whole output: the streaming split, fed it at once."""
    parser = ReasoningParser(starts_in_thought)
    whole, tail = parser.feed(text), parser.finish()
    return ReasoningDelta(whole.reasoning + tail.reasoning, whole.content + tail.content)
