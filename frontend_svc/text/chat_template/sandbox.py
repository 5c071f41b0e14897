"""The jinja2 sandbox chat templates run in: transformers' options and helpers, plus size bounds.

A chat template is code from the model's files. jinja2's ImmutableSandboxedEnvironment
already keeps it away from Python's internals and caps ``range()`` at 100,000 items; what
it leaves open is size: ``'a' * 1500000000`` allocates 1.4 GiB in one step. Here every
operation whose result can be far larger than its inputs is checked *before* it runs, and
refused with ``BudgetError`` when the result would pass ``max_chars``:

    'x' * n, [x] * n                  len(x) * n
    n ** m                            the result's bits (m * log2 |n|), at most 65,536: a larger
                                      int cannot be printed (4,300 digits), and 10 ** 10**7
                                      alone is 15 s of one C call
    a + b (strings, lists)            len(a) + len(b)
    '%9999d' % v, '{:9999}'.format(v) every width and precision in the format
    s.center/ljust/rjust/zfill(w)     w
    s.expandtabs(t)                   tabs * t
    s.replace(a, b), |replace         occurrences * (len(b) - len(a))
    sep.join(xs), |join               len(sep) * (items - 1)
    s.translate(table)                len(s) * the longest replacement
    |center |indent |wordwrap |batch |slice |format |tojson(indent) |lipsum: the same rules

Repetition through loops, ``~`` and namespaces is not counted here; the render process
bounds it (its memory limit and its time budget, chat_template/worker.py). Rendering the
same template in this environment and in transformers' gives the same text: the bounds
only ever refuse, they never change a result.
"""

from __future__ import annotations

import datetime
import json
import math
import re
import string
from collections.abc import Mapping
from typing import Any

import jinja2
import jinja2.ext
import jinja2.filters
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

# The in-process default (Tokenizer.apply_chat_template); the server's renders use
# --chat-template-max-bytes.
DEFAULT_MAX_CHARS = 32 << 20

_MAX_JSON_INDENT = 64  # tojson(indent=...): templates use 2 or 4
_MAX_POWER_BITS = 1 << 16
_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill"})
_PRINTF_NUMBERS = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_DIGITS = re.compile(r"\d+")


class BudgetError(jinja2.sandbox.SecurityError):
    """An operation whose result would pass the template's size budget (refused before it ran)."""


class ChatSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """transformers' chat-template environment (same options, filters and globals), with
    every widening operation checked against ``max_chars``."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        self.max_chars = max_chars
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.globals["lipsum"] = self._lipsum
        self.filters.update(
            tojson=self._tojson,
            center=self._center,
            indent=self._indent,
            wordwrap=self._wordwrap,
            batch=self._batch,
            slice=self._slice,
            format=self._format,
            join=self._join,
            replace=self._replace,
        )

    # -- the check every bound uses

    def check(self, size: float, what: str) -> None:
        if size > self.max_chars:
            raise BudgetError(
                f"{what} would make {_count(size)} characters or items, more than the budget of {self.max_chars}"
            )

    # -- operators

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "+":  # the common one (every template joins its turns with it): first and short
            if type(left) is str and type(right) is str:
                if len(left) + len(right) > self.max_chars:
                    self.check(len(left) + len(right), "joining with +")
                return left + right
            if isinstance(left, (str, bytes, list, tuple)) and isinstance(right, (str, bytes, list, tuple)):
                self.check(len(left) + len(right), "joining with +")
        elif operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
                    self.check(len(seq) * n, "repeating a sequence with *")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
                bits = right * math.log2(abs(left))
                if bits > _MAX_POWER_BITS:
                    raise BudgetError(f"a power with ** would have {_count(bits)} bits, more than {_MAX_POWER_BITS}")
        elif operator == "%" and isinstance(left, (str, bytes)):
            self._check_printf(left, right)
        return self.binop_table[operator](left, right)

    def _check_printf(self, fmt: str | bytes, values: Any) -> None:
        text = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
        if "%" not in text:
            return
        args = values if isinstance(values, tuple) else (values,)
        for width, precision in _PRINTF_NUMBERS.findall(text):
            for number in (width, precision):
                if number.isdigit():
                    self.check(int(number), "a %-format width")
                elif number == "*":  # taken from the values: the largest int there bounds it
                    self.check(max((a for a in args if isinstance(a, int)), default=0), "a %-format width")

    # -- method calls

    def call(
        __self, __context: Any, __obj: Any, *args: Any, **kwargs: Any
    ) -> Any:  # jinja's spelling: no clash with kwargs
        target = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "")
        if isinstance(target, (str, bytes)):
            __self._check_method(target, name, args, kwargs)
        elif name in ("format", "format_map"):  # the sandbox's own wrapper of a str.format method
            wrapped = getattr(getattr(__obj, "__wrapped__", None), "__self__", None)
            if isinstance(wrapped, str):
                __self._check_format(wrapped, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def _check_method(self, s: str | bytes, name: str, args: tuple, kwargs: dict) -> None:
        if name in _WIDTH_METHODS and args and isinstance(args[0], int):
            self.check(args[0], f"str.{name}()")
        elif name == "expandtabs":
            tabsize = args[0] if args else kwargs.get("tabsize", 8)
            if isinstance(tabsize, int):
                tabs = s.count("\t") if isinstance(s, str) else s.count(b"\t")
                self.check(len(s) + tabs * tabsize, "str.expandtabs()")
        elif name == "replace" and len(args) >= 2:
            self.check(_replaced_size(s, args[0], args[1], args[2] if len(args) > 2 else -1), "str.replace()")
        elif name == "join" and args:
            items = args[0] if isinstance(args[0], (list, tuple, str, bytes)) else None
            if items is not None:
                self.check(len(s) * max(len(items) - 1, 0), "str.join()")
        elif name == "translate" and args and isinstance(args[0], Mapping):
            longest = max((len(v) for v in args[0].values() if isinstance(v, (str, bytes))), default=1)
            self.check(len(s) * longest, "str.translate()")
        elif name in ("format", "format_map") and isinstance(s, str):
            self._check_format(s, args, kwargs)

    def _check_format(self, fmt: str, args: tuple, kwargs: dict) -> None:
        try:
            fields = list(string.Formatter().parse(fmt))
        except ValueError:
            return  # str.format raises its own error for it
        for _, field_name, spec, _ in fields:
            if field_name is None or not spec:
                continue
            for number in _DIGITS.findall(spec):
                self.check(int(number), "a str.format width")
            if "{" in spec:  # a width taken from the values: the largest int there bounds it
                values = [*args, *kwargs.values(), *(v for a in args if isinstance(a, Mapping) for v in a.values())]
                self.check(max((v for v in values if isinstance(v, int)), default=0), "a str.format width")

    # -- filters and globals with the same rules

    def _center(self, value: Any, width: int = 80) -> str:
        self.check(width, "|center")
        return jinja2.filters.do_center(value, width)

    def _indent(self, s: str, width: int | str = 4, first: bool = False, blank: bool = False) -> str:
        text, indent = str(s), len(width) if isinstance(width, str) else width
        self.check(len(text) + indent * (text.count("\n") + 1), "|indent")
        return jinja2.filters.do_indent(s, width, first, blank)

    @jinja2.pass_environment
    def _wordwrap(self, environment, s: str, width: int = 79, break_long_words=True, wrapstring=None, **kw) -> str:
        lines = len(s) // max(int(width), 1) + s.count("\n") + 1
        self.check(len(s) + lines * len(wrapstring or environment.newline_sequence), "|wordwrap")
        return jinja2.filters.do_wordwrap(environment, s, width, break_long_words, wrapstring, **kw)

    def _batch(self, value: Any, linecount: int, fill_with: Any = None):
        self.check(linecount, "|batch")
        return jinja2.filters.do_batch(value, linecount, fill_with)

    def _slice(self, value: Any, slices: int, fill_with: Any = None):
        self.check(slices, "|slice")
        return jinja2.filters.sync_do_slice(value, slices, fill_with)

    def _format(self, value: str, *args: Any, **kwargs: Any) -> str:
        self._check_printf(value, kwargs or args)
        return jinja2.filters.do_format(value, *args, **kwargs)

    @jinja2.pass_eval_context
    def _join(self, eval_ctx, value: Any, d: str = "", attribute: Any = None) -> str:
        items = list(value)
        self.check(len(str(d)) * max(len(items) - 1, 0), "|join")
        return jinja2.filters.sync_do_join(eval_ctx, items, d, attribute)

    @jinja2.pass_eval_context
    def _replace(self, eval_ctx, s: str, old: str, new: str, count: int | None = None) -> str:
        self.check(_replaced_size(str(s), str(old), str(new), -1 if count is None else count), "|replace")
        return jinja2.filters.do_replace(eval_ctx, s, old, new, count)

    def _tojson(self, value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        if indent is not None and (len(indent) if isinstance(indent, str) else indent) > _MAX_JSON_INDENT:
            raise BudgetError(f"tojson's indent is at most {_MAX_JSON_INDENT}, got {indent!r}")
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def _lipsum(self, n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # jinja's names
        self.check(n * max * 12, "lipsum()")  # 12: more than the longest word and its space
        return jinja2.utils.generate_lorem_ipsum(n, html, min, max)


def _replaced_size(s: Any, old: Any, new: Any, count: Any) -> float:
    if not (isinstance(s, (str, bytes)) and type(old) is type(s) and type(new) is type(s)):
        return 0
    hits = len(s) + 1 if not old else s.count(old)  # type: ignore[arg-type] # old is of s's type
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * (len(new) - len(old))


def _count(size: float) -> str:
    return f"{size:.3g}" if size >= 1e15 else str(int(size))


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers some templates
    carry) renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _render(caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def template_variables(
    specials: Mapping[str, str], messages: Any, add_generation_prompt: bool, extra: Mapping[str, Any]
) -> dict[str, Any]:
    """What a template sees, as transformers gives it: the special tokens, the caller's
    variables (tools, enable_thinking ...), then the conversation, which nothing overrides."""
    return {**specials, **extra, "messages": messages, "add_generation_prompt": add_generation_prompt}
