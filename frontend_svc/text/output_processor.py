"""Engine outputs -> public outputs, one ``ChoiceProcessor`` per choice of a request.

    EngineOutput (token ids, logprobs, finish)                       per step, maybe merged
        -> IncrementalDetokenizer.push()   token ids -> text delta
        -> StopChecker.process()           hold back possible stop prefixes, find matches
        -> MessageParser.feed()            reasoning, tool calls, content (when asked for)
        -> ChoiceOutput (text, token ids, logprobs with token text, finish, usage)

A stop string ends the choice on the token whose text completed it: later tokens of the
same engine output are dropped (not counted, not returned) and the caller aborts the
engine request (``ChoiceOutput.abort_engine``). Stop strings are searched only in text
produced after the first ``min_tokens`` output tokens. When the engine stops on a stop
token (EOS or stop_token_ids), that token counts as generated but its text is left out
unless ``include_stop_str_in_output`` is set, as in vLLM.

Reasoning and tool calls are split from the text after stop strings are applied, so a
stop string ends the answer wherever it falls (even inside a call) and the parsers see
exactly the text a client without them would. A choice that ends as STOP with tool calls
in its answer ends as TOOL_CALLS; one cut by max_tokens stays LENGTH, calls and all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from frontend_svc.text.detokenizer import IncrementalDetokenizer
from frontend_svc.text.message_parser import AssistantMessage, MessageFormat, MessageParser, ToolCallPiece
from frontend_svc.text.stop_checker import StopChecker
from frontend_svc.text.tokenizer import Tokenizer
from frontend_svc.types import EngineOutput
from tandem_common.types import FinishReason, Logprob


@dataclass
class TextParams:
    """The per-request options the frontend applies to the token stream."""

    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0
    return_token_ids: bool = False
    prompt_logprobs: bool = False  # this choice carries the prompt logprobs
    message: MessageFormat = field(default_factory=MessageFormat)  # reasoning / tool-call split


@dataclass
class TopLogprobText:
    token_id: int
    token: str
    logprob: float


@dataclass
class LogprobText:
    token_id: int
    token: str
    logprob: float
    rank: int
    top: list[TopLogprobText] = field(default_factory=list)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class ChoiceOutput:
    """One streamed piece of one choice; the last one has finish_reason and usage."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobText] = field(default_factory=list)
    prompt_logprobs: list[LogprobText] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_str: str | None = None
    stop_token_id: int | None = None
    usage: Usage | None = None
    abort_engine: bool = False  # a stop string ended it while the engine request still runs
    reasoning: str = ""  # new thought text (a reasoning parser runs); never in ``text``
    tool_calls: list[ToolCallPiece] = field(default_factory=list)  # new pieces of calls
    message: AssistantMessage | None = None  # the whole answer, on the last piece (parsers run)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class TokenTexts:
    """The text of single tokens (logprobs, Tokenize), cached per token id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            try:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            except ValueError:  # a model vocabulary larger than the tokenizer's
                text = ""
            self._cache[token_id] = text
        return text

    def logprob(self, lp: Logprob) -> LogprobText:
        top = [TopLogprobText(t, self(t), v) for t, v in lp.top]
        return LogprobText(lp.token_id, self(lp.token_id), lp.logprob, lp.rank, top)


class ChoiceProcessor:
    def __init__(
        self,
        index: int,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        params: TextParams,
        token_texts: TokenTexts | None = None,
    ) -> None:
        self.index = index
        self.params = params
        self.finished = False
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_output_tokens = 0  # tokens counted as generated (stop at a stop string)
        self.num_cached_tokens = 0
        self._texts = token_texts or TokenTexts(tokenizer)
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self._stop = StopChecker(params.stop, params.include_stop_str_in_output)
        self._has_stops = any(params.stop)
        self._prompt_logprobs: list[LogprobText] = []
        self._prompt_logprobs_sent = not params.prompt_logprobs
        self._message = MessageParser(params.message) if params.message.active else None

    def process(self, out: EngineOutput) -> ChoiceOutput | None:
        """Turns one (possibly merged) engine output into the choice's next piece.

        Returns None when there is nothing to send yet (text held back, nothing else new).
        The caller handles outputs with an error before calling this.
        """
        if self.finished:
            return None
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if not self._prompt_logprobs_sent:
            self._prompt_logprobs.extend(self._texts.logprob(lp) for lp in out.prompt_logprobs)

        ids = out.new_token_ids
        # The engine's stop token is counted but not detokenized (vLLM's convention).
        hide_last = (
            out.finish_reason is FinishReason.STOP
            and out.stop_token_id is not None
            and bool(ids)
            and ids[-1] == out.stop_token_id
            and not self.params.include_stop_str_in_output
        )
        text, matched, num_taken = self._push_tokens(ids, hide_last)
        piece = ChoiceOutput(
            self.index, text, list(ids[:num_taken]), [self._texts.logprob(lp) for lp in out.logprobs[:num_taken]]
        )
        if matched is not None:
            self._finish(piece, FinishReason.STOP, stop_str=matched)
            piece.abort_engine = not out.finished
        elif out.finished:
            tail, matched = self._stop.process(self._detok.flush(), check=self._checking)
            piece.text += tail
            if matched is not None:
                self._finish(piece, FinishReason.STOP, stop_str=matched)
            else:
                piece.text += self._stop.finish()
                stop_token_id = out.stop_token_id if out.finish_reason is FinishReason.STOP else None
                self._finish(piece, out.finish_reason, stop_token_id=stop_token_id)

        if self._message is not None:
            self._split(piece, self._message)
        if not self._prompt_logprobs_sent and (ids or piece.finished):
            piece.prompt_logprobs, self._prompt_logprobs = self._prompt_logprobs, []
            self._prompt_logprobs_sent = True
        has_news = (
            piece.text
            or piece.reasoning
            or piece.tool_calls
            or piece.logprobs
            or piece.prompt_logprobs
            or (self.params.return_token_ids and piece.token_ids)
        )
        return piece if has_news or piece.finished else None

    def _split(self, piece: ChoiceOutput, parser: MessageParser) -> None:
        """Replaces the piece's text by its content, reasoning and call pieces."""
        delta = parser.feed(piece.text)
        if piece.finished:
            tail = parser.finish()
            delta.content += tail.content
            delta.reasoning += tail.reasoning
            delta.tool_calls.extend(tail.tool_calls)
            piece.message = parser.message(cut=piece.finish_reason is FinishReason.LENGTH)
            if piece.message.tool_calls and piece.finish_reason is FinishReason.STOP:
                piece.finish_reason = FinishReason.TOOL_CALLS
        piece.text, piece.reasoning, piece.tool_calls = delta.content, delta.reasoning, delta.tool_calls

    @property
    def _checking(self) -> bool:
        return self.num_output_tokens > self.params.min_tokens

    def _push_tokens(self, ids: Sequence[int], hide_last: bool) -> tuple[str, str | None, int]:
        """Detokenizes and stop-checks ``ids``; returns (text, matched stop, tokens consumed)."""
        if not self._has_stops:
            self.num_output_tokens += len(ids)
            visible = ids[:-1] if hide_last else ids
            return self._stop.process(self._detok.push(visible), check=False)[0], None, len(ids)
        parts = []
        for i, token_id in enumerate(ids):
            self.num_output_tokens += 1
            delta = "" if hide_last and i == len(ids) - 1 else self._detok.push([token_id])
            released, matched = self._stop.process(delta, check=self._checking)
            parts.append(released)
            if matched is not None:
                return "".join(parts), matched, i + 1
        return "".join(parts), None, len(ids)

    def _finish(
        self,
        piece: ChoiceOutput,
        reason: FinishReason | None,
        *,
        stop_str: str | None = None,
        stop_token_id: int | None = None,
    ) -> None:
        self.finished = True
        piece.finish_reason = reason
        piece.stop_str = stop_str
        piece.stop_token_id = stop_token_id
        piece.usage = Usage(self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens)
