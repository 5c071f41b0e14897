"""A template tried once at start, on conversations of every shape, before it serves anyone.

    open_renderer(source, specials, origin, budget)
        ── TemplateRenderer.start()             the template compiles in its budget
        ── render each of PROBES                 every turn kind, a tool call and its result, tools or not
        ──▶ the renderer, serving                 (a probe the template refuses is logged, not fatal)
        ──▶ TemplateRefused(why, naming origin)   a probe past the budget, or none that renders

Refused: a template that does not compile, that passes its time, size or memory budget or
recurses without end on any probe (these conversations are small, so it would on every
request), or that renders none of them. Not refused: a template that raises on one shape
(many refuse a system turn, or tools): it serves the others, as it would in transformers.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from frontend_svc.text.chat_template.renderer import RenderError, TemplateBudget, TemplateRenderer

logger = logging.getLogger(__name__)

_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city's name."}},
                "required": ["city"],
            },
        },
    }
]
_SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
_USER = {"role": "user", "content": "What is the weather in Paris?"}
# As planning hands them to templates (service/message_plan.py): arguments as an object.
_CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ],
}
_RESULT = {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"celsius": 21}'}


@dataclass(frozen=True)
class Probe:
    name: str
    messages: list[dict[str, Any]]
    variables: dict[str, Any] = field(default_factory=dict)


PROBES = (
    Probe("a user turn", [_USER]),
    Probe(
        "system, user and assistant turns",
        [_SYSTEM, _USER, {"role": "assistant", "content": "Sunny, 21 °C."}, {"role": "user", "content": "Thanks!"}],
    ),
    Probe("a user turn with tools", [_USER], {"tools": _TOOLS}),
    Probe("a tool call and its result, with tools", [_SYSTEM, _USER, _CALL, _RESULT], {"tools": _TOOLS}),
)


_FIX = "fix the template or replace it (--tokenizer DIR with a chat_template.jinja)"


class TemplateRefused(Exception):
    """The model's chat template cannot serve; the message names its file and says why."""


async def open_renderer(source: str, specials: dict[str, str], origin: str, budget: TemplateBudget) -> TemplateRenderer:
    """The template's renderer, started and probed; TemplateRefused when it cannot serve
    (its processes are stopped then). RenderUnavailable when no render process starts."""
    renderer = TemplateRenderer(source, specials, origin, budget)
    try:
        t0 = time.perf_counter()
        await renderer.start()
        refused = [await _try(renderer, probe) for probe in PROBES]
        failed = [(probe, e) for probe, e in zip(PROBES, refused) if e is not None]
    except RenderError as error:  # from start(): it does not compile, or not within the budget
        await renderer.close()
        raise TemplateRefused(f"{error}; {_FIX}") from None
    except BaseException:
        await renderer.close()
        raise
    fatal = next(((probe, e) for probe, e in failed if e.over_budget), None)
    if fatal is not None:
        await renderer.close()
        raise TemplateRefused(f"{fatal[1]} (start-up test: {fatal[0].name}); {_FIX}")
    if len(failed) == len(PROBES):
        await renderer.close()
        first, why = failed[0]
        raise TemplateRefused(
            f"{renderer.what} renders none of the start-up test conversations ({first.name}: {why}); {_FIX}"
        )
    for probe, why in failed:
        logger.warning("%s refuses %s (requests of that shape will be refused too): %s", renderer.what, probe.name, why)
    logger.info(
        "%s renders %d of %d test conversations (%.0f ms); each render within %g s and %d bytes, %d render processes "
        "(--chat-template-timeout-s, --chat-template-max-bytes, --chat-template-workers)",
        renderer.what,
        len(PROBES) - len(failed),
        len(PROBES),
        (time.perf_counter() - t0) * 1e3,
        budget.timeout_s,
        budget.max_bytes,
        budget.num_workers,
    )
    return renderer


async def _try(renderer: TemplateRenderer, probe: Probe) -> RenderError | None:
    try:
        await renderer.render(probe.messages, True, probe.variables)
    except RenderError as e:
        return e
    return None
