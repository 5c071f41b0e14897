"""The grammar engine behind structured output: llguidance, behind four verbs.

    StructuredOutput ─▶ LLGuidanceBackend.compile() ─▶ CompiledGrammar   (a worker thread)
    CompiledGrammar.matcher() ─▶ Matcher: consume(token ids), is_stopped(), error()
    fill_bitmasks([(matcher, row), ...], bitmask)     next-token masks of a batch, GIL released

Only this module imports llguidance; a second library (xgrammar) would be a second
backend with the same verbs. Bitmask layout, shared by both libraries: int32
[rows, ceil(vocab / 32)], bit i (little-endian) of word w allows token 32 * w + i.

Why llguidance (measured in benchmarks/figures/structured_output.md): an 8 MB wheel
with no dependencies (xgrammar pulls triton, ~1 GB); a 30-field schema compiles and gives
its first mask in a few ms (xgrammar: 14-100 ms); correct JSON strings and special tokens
where xgrammar was not. Its gotchas, handled here: it never raises on a bad grammar (the
matcher is born in a sticky error state), the first mask builds the lexer lazily (done
in compile(), off the step thread), and its LLTokenizer takes seconds to build at large
vocabularies while holding the GIL (built once, at engine start).
"""

from __future__ import annotations

import ctypes
import json
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from tandem_common.sampling import StructuredOutput

logger = logging.getLogger(__name__)

# Any JSON object, for json_object (the same compiler as json_schema, so the same options).
_ANY_OBJECT_SCHEMA = '{"type": "object"}'
# What one grammar may cost (docs/limits.md). Fuel is llguidance's unit of lexer work
# (~50k/ms to build, ~14k/ms per mask); a lexer state holds 1-2 kB. The defaults let one
# 14-byte regex take a second and ~190 MiB; these cap a compile at ~0.1 s and ~40 MiB and a
# grammar's lexer, which grows while it decodes, at ~40 MiB, while a 1,500-field schema
# still compiles. Runtime messages leave out the parser-state dump (it can quote the schema).
INITIAL_LEXER_FUEL = 200_000
STEP_LEXER_FUEL = 200_000
MAX_LEXER_STATES = 20_000
MAX_GRAMMAR_SIZE = 500_000  # symbols in the grammar's productions
_LIMITS = llguidance.LLParserLimits(
    initial_lexer_fuel=INITIAL_LEXER_FUEL,
    step_lexer_fuel=STEP_LEXER_FUEL,
    max_lexer_states=MAX_LEXER_STATES,
    max_grammar_size=MAX_GRAMMAR_SIZE,
    verbose_errors=False,
)


class GrammarError(Exception):
    """The constraint cannot be compiled; the message is the library's, fit for the client."""


class Matcher:
    """One request's position in its grammar."""

    __slots__ = ("_m",)

    def __init__(self, m: llguidance.LLMatcher) -> None:
        self._m = m

    def consume(self, token_ids: Sequence[int]) -> bool:
        """Advance past ``token_ids``; False (and a sticky error) if the grammar refuses one."""
        return self._m.consume_tokens(list(token_ids))

    def num_valid(self, token_ids: Sequence[int]) -> int:
        """How many leading ``token_ids`` the grammar accepts from here; changes nothing."""
        return self._m.validate_tokens(list(token_ids))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` consumed (draft tokens that were only tried)."""
        self._m.rollback(num_tokens)

    def is_stopped(self) -> bool:
        """Nothing but EOS may follow (the grammar is complete and cannot go on)."""
        return self._m.is_stopped()

    def error(self) -> str:
        """Why the matcher failed ("" while it has not)."""
        return self._m.get_error()


class CompiledGrammar:
    """A compiled constraint: a pristine matcher whose copies start each request.

    A copy shares the compiled grammar and its lexer, so it costs microseconds; it is
    never mutated itself, so copies may be taken from any thread. ``first_mask`` is the
    mask before any token, computed by compile() off the step thread: a fresh copy would
    spend as long again computing it on the step thread (0.1 s for some regexes).
    ``failure`` is set (on the engine thread) when a request's matcher fails on it: the
    grammar is over a limit, and every later request for it fails at once.
    """

    __slots__ = ("_pristine", "failure", "first_mask", "num_bytes", "vocab_size")

    def __init__(self, pristine: llguidance.LLMatcher, vocab_size: int, first_mask: np.ndarray, num_bytes: int) -> None:
        self._pristine = pristine
        self.vocab_size = vocab_size  # the bitmask covers this many token ids
        self.first_mask = first_mask  # int32 [ceil(vocab / 32)]
        self.num_bytes = num_bytes  # heap the compile kept, as measured (an estimate)
        self.failure = ""

    def matcher(self) -> Matcher:
        return Matcher(self._pristine.deep_copy())


class LLGuidanceBackend:
    """Compiles constraints against one tokenizer. Thread-safe: compile() runs on workers."""

    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        if not eos_token_ids:
            raise ValueError("structured output needs an EOS token: the model declares none")
        # Ids past the model's vocabulary (a tokenizer larger than the LM head) get bits
        # too; the sampler reads only the model's columns, so they are never allowed.
        self.vocab_size = max(vocab_size, _num_token_ids(tokenizer_json))
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=self.vocab_size, eos_token=[int(t) for t in eos_token_ids]
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int]) -> LLGuidanceBackend:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: structured output needs the model's tokenizer.json")
        return cls(path.read_text(encoding="utf-8"), vocab_size, eos_token_ids)

    def compile(self, constraint: StructuredOutput) -> CompiledGrammar:
        """Compile ``constraint``; raises GrammarError with the library's message."""
        heap_before = heap_bytes()
        matcher = llguidance.LLMatcher(self.tokenizer, _grammar(constraint), log_level=0, limits=_LIMITS)
        first_mask = llg_numpy.allocate_token_bitmask(1, self.vocab_size)
        if not matcher.is_error():
            # The first mask builds the lexer (milliseconds); copies then share it.
            llg_numpy.fill_next_token_bitmask(matcher, first_mask, 0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error().strip())
        # Another thread's allocations can land in the difference: a compile running beside
        # this one is counted twice (the cache then holds less, never more, than its bound).
        num_bytes = max(heap_bytes() - heap_before, len(constraint.text) + sum(map(len, constraint.choices)))
        return CompiledGrammar(matcher, self.vocab_size, first_mask[0].copy(), num_bytes + first_mask.nbytes)


def fill_bitmasks(rows: Sequence[tuple[Matcher, int]], bitmask: np.ndarray) -> None:
    """Write each matcher's next-token mask into its row of ``bitmask`` (int32, C order)."""
    if not rows:
        return
    if len(rows) == 1:
        matcher, row = rows[0]
        llg_numpy.fill_next_token_bitmask(matcher._m, bitmask, row)
        return
    llg_numpy.fill_next_token_bitmask_par(_executor(), [(m._m, row) for m, row in rows], bitmask)


_executor_lock = threading.Lock()
_executor_instance: llguidance.LLExecutor | None = None


def _executor() -> llguidance.LLExecutor:
    """One pool of mask threads per process (llguidance's default size: most of the CPUs)."""
    global _executor_instance
    with _executor_lock:
        if _executor_instance is None:
            _executor_instance = llguidance.LLExecutor()
        return _executor_instance


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2``: ten size_t counters."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def _load_mallinfo2() -> Callable[[], _MallInfo2] | None:
    try:
        fn = ctypes.CDLL(None).mallinfo2  # glibc 2.33+; llguidance allocates through malloc
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


_mallinfo2 = _load_mallinfo2()


def heap_bytes() -> int:
    """Bytes the process holds from malloc now (in use, not merely mapped); 0 where unknown."""
    if _mallinfo2 is None:
        return 0
    info = _mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _grammar(c: StructuredOutput) -> str:
    """The llguidance grammar for a constraint the shared checks have passed."""
    if c.kind in ("json_schema", "json_object"):
        options = {"whitespace_flexible": c.json_whitespace == "flexible", "lenient": c.json_lenient}
        text = c.text if c.kind == "json_schema" else _ANY_OBJECT_SCHEMA
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=options)  # type: ignore[arg-type]
        except ValueError as e:
            raise GrammarError(str(e)) from e
    if c.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(c.text)
    if c.kind == "choice":
        # Lark string literals take JSON escapes: start: "a" | "b\"c" | ...
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in c.choices))
    if c.kind == "grammar" and c.grammar_syntax == "gbnf":
        try:
            return llguidance.grammar_from("gbnf", c.text)
        except ValueError as e:  # the GBNF -> Lark converter raises; its message says what
            raise GrammarError(str(e)) from e
    if c.kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(c.text)
    raise GrammarError(f"unknown constraint kind {c.kind!r}")


def _num_token_ids(tokenizer_json: str) -> int:
    """1 + the largest id a Hugging Face tokenizer.json defines (model vocab and added tokens)."""
    data = json.loads(tokenizer_json)
    vocab = data.get("model", {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1]  # Unigram: a list
    ids += [t["id"] for t in data.get("added_tokens") or []]
    return 1 + max((int(i) for i in ids), default=-1)
