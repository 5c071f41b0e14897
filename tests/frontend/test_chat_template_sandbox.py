"""The chat-template sandbox: every widening operation refused before it runs, every
ordinary template rendered exactly as jinja2's own sandbox renders it."""

from __future__ import annotations

import jinja2.sandbox
import pytest

from frontend_svc.text.chat_template.sandbox import BudgetError, ChatSandbox, template_variables
from frontend_svc.text.nesting import MAX_NESTING, TooDeep, loads, nesting
from tests.chat_templates import CHATML, HERMES_THINKING

MAX = 1 << 20

BOMBS = [
    "{{ 'a' * 1500000000 }}",
    "{{ 1500000000 * 'a' }}",
    "{{ [0] * 1500000000 }}",
    "{{ 10 ** 10000000 }}",
    "{% set s = 'a' * 800000 %}{{ s + s }}",
    "{{ '%1500000000d' % 1 }}",
    "{{ '%*d' % (1500000000, 1) }}",
    "{{ '{:1500000000}'.format(1) }}",
    "{{ '{:{w}}'.format(1, w=1500000000) }}",
    "{{ 'a'.center(1500000000) }}",
    "{{ 'a'.ljust(1500000000) }}",
    "{{ 'a'.zfill(1500000000) }}",
    "{{ ('\t' * 1000).expandtabs(1500000) }}",
    "{{ ('a' * 100000).replace('a', 'b' * 100000) }}",
    "{{ ('x' * 100000).join('y' * 100000) }}",
    "{{ ('a' * 100000).translate({97: 'b' * 100000}) }}",
    "{{ 'a' | center(1500000000) }}",
    "{{ ('a\n' * 1000) | indent(1500000) }}",
    "{{ ('a' * 100000) | replace('a', 'b' * 100000) }}",
    "{{ ('y' * 100000) | join('x' * 100000) }}",
    "{{ '%1500000000d' | format(1) }}",
    "{{ [1] | batch(1500000000, 0) | list }}",
    "{{ [1] | slice(1500000000) | list }}",
    "{{ messages | tojson(indent=1000000) }}",
    "{{ ('a ' * 100000) | wordwrap(1, wrapstring='x' * 100000) }}",
    "{{ lipsum(1000000) }}",
]


@pytest.mark.parametrize("template", BOMBS)
def test_every_widening_operation_is_refused_before_it_runs(template):
    compiled = ChatSandbox(MAX).from_string(template)
    with pytest.raises(BudgetError):
        compiled.render(messages=[{"role": "user", "content": "hi"}])


def test_within_the_budget_they_run_as_usual():
    env = ChatSandbox(MAX)
    rendered = env.from_string(
        "{{ 'ab' * 3 }}|{{ 2 ** 10 }}|{{ '%5d' % 7 }}|{{ '{:>4}'.format('x') }}|{{ 'a'.center(5) }}"
        "|{{ ['a', 'b'] | join(', ') }}|{{ 'aXa' | replace('X', 'yy') }}|{{ [1, 2, 3] | batch(2, 0) | list }}"
    ).render()
    assert rendered == "ababab|1024|    7|   x|  a  |a, b|ayya|[[1, 2], [3, 0]]"


@pytest.mark.parametrize("template", [CHATML, HERMES_THINKING])
def test_ordinary_templates_render_exactly_as_in_jinjas_own_sandbox(template):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Bonjour, ça va ? 😀"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {"x": [1, 2]}}}],
        },
        {"role": "tool", "content": "42"},
    ]
    variables = template_variables({"bos_token": "<s>"}, messages, True, {"tools": tools})
    plain = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    plain.filters["tojson"] = ChatSandbox()._tojson
    assert ChatSandbox(MAX).from_string(template).render(**variables) == plain.from_string(template).render(**variables)


def test_nesting_is_measured_without_recursion():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert nesting(deep) == MAX_NESTING + 1  # stops as soon as it passes the limit
    assert nesting({"a": [1, {"b": 2}]}) == 3 and nesting("text") == 0
    with pytest.raises(TooDeep):
        loads("[" * 5000 + "]" * 5000)  # json.loads alone raises RecursionError here
    with pytest.raises(TooDeep):
        loads("[" * 200 + "]" * 200)
    assert loads("[" * 100 + "]" * 100) is not None


def test_nothing_widens_while_the_template_compiles():
    # jinja2 folds constant expressions as it compiles: without the bounds this would
    # allocate 1.4 GiB before any conversation, even though the branch never runs.
    compiled = ChatSandbox(MAX).from_string("{% if false %}{{ 'a' * 1500000000 }}{{ 'b' | center(10**9) }}{% endif %}")
    assert compiled.render() == ""
