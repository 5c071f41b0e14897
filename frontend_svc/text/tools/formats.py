"""The tool-call formats, one object each, in one table.

    name          what the model writes                                        models
    hermes        <tool_call>{"name": ..., "arguments": {...}}</tool_call>      Hermes, Qwen2.5, Qwen3
    llama3_json   [<|python_tag|>]{"name": ..., "parameters": {...}}[; ...]     Llama 3.1 / 3.2 / 3.3
    mistral       [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]          Mistral, Mixtral
                  [TOOL_CALLS]name[ARGS]{...}  (tokenizer v11 on)              Mistral Small 3.2, Magistral, Devstral
    pythonic      [f(a=1), g(b="x")]                                            Llama 3.2 / 4 (pythonic)
    json          {"name": ..., "arguments": {...}}  or a JSON array of them   any model (no native format)

A format is everything the frontend knows of it: its name (--tool-call-parser), the sign
that shows it in a chat template, the tags its parser must see in the text (kept when they
are special tokens), the key its calls write the arguments under, its streaming parser (the
complete parse is that parser fed the whole text), the rule that forces its calls
(forcing.py; None: it cannot be forced), and how calls are written in it (for a template
that does not show tools: the example of the generic system prompt, and earlier calls as
text; prompt.py). A new format is one row here and, if no parser
reads it yet, one parser class.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from tandem_common.sampling import StructuredOutput

from .forcing import CallsRule, Forced, ForcingError, arguments_rule, calls_grammar
from .leading import LeadingCallParser
from .prompt import CallWriter
from .pythonic import END_TAG, START_TAG, PythonicCallParser
from .spec import ToolRequest
from .tagged import ARGS_TAG, TaggedCallParser
from .types import ParsedDelta, ParsedMessage


class ToolCallParser(Protocol):
    """One output's parse: ``feed`` text deltas, then ``finish`` once; then ``message``."""

    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta: ...

    def message(self) -> ParsedMessage: ...


@dataclass(frozen=True)
class ToolCallFormat:
    """One format, all of it (see the module's docstring)."""

    name: str  # as --tool-call-parser spells it
    template_sign: str | None  # text that shows the format in a chat template; None: nothing does
    tags: tuple[str, ...]  # what the parser must see in the text: special tokens are kept then
    new_parser: Callable[[], ToolCallParser]
    forcing: CallsRule | None  # the grammar's ``calls`` rule; None: the format cannot be forced
    write_calls: CallWriter  # calls as the model writes them in this format
    arguments_key: str = "arguments"  # what forced calls name the arguments (parsers read either key)
    forms: tuple[ToolCallFormat, ...] = ()  # the format as other templates write it, each by its sign

    def parse(self, text: str) -> ParsedMessage:
        """The complete parse of a whole output: the streaming parse, fed it at once."""
        parser = self.new_parser()
        parser.feed(text)
        parser.finish()
        return parser.message()

    def for_template(self, chat_template: str | None) -> ToolCallFormat:
        """This format in the form the chat template shows."""
        shown = (f for f in self.forms if chat_template and f.template_sign and f.template_sign in chat_template)
        return next(shown, self)


_TOOL_CALL, _TOOL_CALL_END = "<tool_call>", "</tool_call>"
_TOOL_CALLS = "[TOOL_CALLS]"
_PYTHON_TAG = "<|python_tag|>"


def _hermes_calls(f: Forced) -> list[str]:
    """<tool_call>\\n%json{call}\\n</tool_call> ("\\n" <tool_call>...)*"""
    one = f'one: {f.tag(_TOOL_CALL)} "\\n" call "\\n" {f.tag(_TOOL_CALL_END)}'
    return [f.call, one, 'calls: one ("\\n" one)*' if f.many else "calls: one"]


def _mistral_calls(f: Forced) -> list[str]:
    """[TOOL_CALLS] "[" %json{call} ("," %json{call})* "]" """
    return [f.call, f'calls: {f.tag(_TOOL_CALLS)} "[" call ' + ('("," call)* "]"' if f.many else '"]"')]


def _mistral_named_calls(f: Forced) -> list[str]:
    """([TOOL_CALLS] name [ARGS] %json{the tool's arguments schema})+"""
    tag, args = f.tag(_TOOL_CALLS), f.tag(ARGS_TAG)
    return [
        "one: " + " | ".join(f"one_{i}" for i in range(len(f.tools))),
        *(f"one_{i}: {tag} {json.dumps(t.name)} {args} {arguments_rule(t)}" for i, t in enumerate(f.tools)),
        "calls: one+" if f.many else "calls: one",
    ]


def _llama3_calls(f: Forced) -> list[str]:
    """%json{call} (";" %json{call})*"""
    return [f.call, 'calls: call (";" call)*' if f.many else "calls: call"]


def _json_calls(f: Forced) -> list[str]:
    """%json{call}, or (parallel) also "[" %json{call} ("," %json{call})* "]" """
    return [f.call, 'calls: call | "[" call ("," call)* "]"' if f.many else "calls: call"]


def _call_object(key: str) -> Callable[[str, dict[str, Any]], str]:
    return lambda name, arguments: json.dumps({"name": name, key: arguments}, ensure_ascii=False)


def _write_hermes(calls: Sequence[tuple[str, dict[str, Any]]]) -> str:
    one = _call_object("arguments")
    return "\n".join(f"{_TOOL_CALL}\n{one(n, a)}\n{_TOOL_CALL_END}" for n, a in calls)


def _write_llama3(calls: Sequence[tuple[str, dict[str, Any]]]) -> str:
    return "; ".join(_call_object("parameters")(n, a) for n, a in calls)


def _write_mistral(calls: Sequence[tuple[str, dict[str, Any]]]) -> str:
    return _TOOL_CALLS + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)


def _write_mistral_named(calls: Sequence[tuple[str, dict[str, Any]]]) -> str:
    return "".join(f"{_TOOL_CALLS}{n}{ARGS_TAG}{json.dumps(a, ensure_ascii=False)}" for n, a in calls)


def _write_pythonic(calls: Sequence[tuple[str, dict[str, Any]]]) -> str:
    # Python literals (repr) are what the parser's ast reads back.
    return "[" + ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls) + "]"


def _write_json(calls: Sequence[tuple[str, dict[str, Any]]]) -> str:
    objects = [{"name": n, "arguments": a} for n, a in calls]
    return json.dumps(objects[0] if len(objects) == 1 else objects, ensure_ascii=False)


HERMES = ToolCallFormat(
    "hermes",
    template_sign=_TOOL_CALL,
    tags=(_TOOL_CALL, _TOOL_CALL_END),
    new_parser=lambda: TaggedCallParser(_TOOL_CALL, _TOOL_CALL_END, allow_array=True),
    forcing=_hermes_calls,
    write_calls=_write_hermes,
)
LLAMA3_JSON = ToolCallFormat(
    "llama3_json",
    template_sign=_PYTHON_TAG,
    tags=(_PYTHON_TAG,),
    new_parser=lambda: LeadingCallParser(_PYTHON_TAG, ";", allow_array=False),
    forcing=_llama3_calls,
    write_calls=_write_llama3,
    arguments_key="parameters",
)
_MISTRAL = ToolCallFormat(
    "mistral",
    template_sign=_TOOL_CALLS,
    tags=(_TOOL_CALLS,),
    new_parser=lambda: TaggedCallParser(_TOOL_CALLS, None, allow_array=True, named_form=True),
    forcing=_mistral_calls,
    write_calls=_write_mistral,
)
# Templates that show [ARGS] write one name[ARGS]{...} per call; the parser reads both forms.
MISTRAL = replace(
    _MISTRAL,
    forms=(replace(_MISTRAL, template_sign=ARGS_TAG, forcing=_mistral_named_calls, write_calls=_write_mistral_named),),
)
PYTHONIC = ToolCallFormat(
    "pythonic",
    template_sign=START_TAG,
    tags=(START_TAG, END_TAG),
    new_parser=PythonicCallParser,
    forcing=None,  # Python syntax, not JSON
    write_calls=_write_pythonic,
)
JSON = ToolCallFormat(
    "json",
    template_sign=None,
    tags=(),
    new_parser=lambda: LeadingCallParser(None, "", allow_array=True),
    forcing=_json_calls,
    write_calls=_write_json,
)

FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, PYTHONIC, JSON)}
# The order a chat template's signs are looked for in, most specific first (a template may
# show more than one).
_BY_TEMPLATE_SIGN = (HERMES, MISTRAL, PYTHONIC, LLAMA3_JSON)
# The formats a grammar can force, in the order the refusal for the others names them.
FORCEABLE = tuple(f.name for f in (*_BY_TEMPLATE_SIGN, JSON) if f.forcing is not None)


def format_named(name: str) -> ToolCallFormat:
    """The format called ``name``; ValueError naming the known ones otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(FORMATS)}") from None


def parser_for_template(chat_template: str | None) -> ToolCallFormat:
    """The format a chat template shows, in the form it shows; else the generic JSON one."""
    for fmt in _BY_TEMPLATE_SIGN:
        if chat_template and fmt.template_sign and fmt.template_sign in chat_template:
            return fmt.for_template(chat_template)
    return JSON


def format_for(name: str | None, chat_template: str | None) -> ToolCallFormat:
    """The format ``name`` (--tool-call-parser) names, else the one the chat template shows;
    in the form the template writes."""
    if name:
        return format_named(name).for_template(chat_template)
    return parser_for_template(chat_template)


def tools_grammar(
    fmt: ToolCallFormat,
    request: ToolRequest,
    answer: StructuredOutput | None,
    special_token_id: Callable[[str], int | None],
    *,
    thought: str | None = None,
) -> str:
    """The grammar that forces ``request``'s calls in ``fmt`` (forcing.py)."""
    if fmt.forcing is None:
        raise ForcingError(
            f"the {fmt.name} tool-call format cannot be forced by a grammar; "
            f"tool_choice required or a named function needs one of: {', '.join(FORCEABLE)}"
        )
    return calls_grammar(fmt.forcing, fmt.arguments_key, request, answer, special_token_id, thought)
