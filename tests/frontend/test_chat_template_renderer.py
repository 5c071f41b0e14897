"""The chat-template renderer with its real render processes: each bound fails its own
render, a process that stops answering is killed and replaced while the others serve, and
none outlives close() or its frontend. No engine: the renderer alone, in this process."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from frontend_svc.text.chat_template.probe import TemplateRefused, open_renderer
from frontend_svc.text.chat_template.renderer import KILL_GRACE_S, RenderError, TemplateBudget, TemplateRenderer
from tests.chat_templates import CHATML, HOSTILE, LOOPS_ALWAYS

BUDGET = TemplateBudget(timeout_s=0.5, max_bytes=1 << 20, num_workers=2)
SPECIALS = {"bos_token": "<s>"}


def turn(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def pids(renderer: TemplateRenderer) -> list[int]:
    return [p.proc.pid for p in renderer._live]


@pytest.fixture
async def renderer():
    r = await open_renderer(HOSTILE, SPECIALS, "hostile.jinja", BUDGET)
    yield r
    await r.close()


async def test_each_bound_fails_its_own_render(renderer):
    assert await renderer.render(turn("hi"), True, {}) == "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    for text, kind in (("loop", "timeout"), ("bomb", "size"), ("recurse", "recursion")):
        with pytest.raises(RenderError) as failed:
            await renderer.render(turn(text), True, {})
        assert failed.value.kind == kind and "hostile.jinja" in str(failed.value)
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(RenderError) as failed:  # cannot even be written down for the process
        await renderer.render(turn("hi"), True, {"deep": deep})
    assert failed.value.kind == "input"
    assert await renderer.render(turn("still here"), False, {}) == "<s><|im_start|>user\nstill here<|im_end|>\n"


async def test_a_process_that_stops_answering_is_killed_and_replaced(renderer):
    before = pids(renderer)
    for pid in before:  # neither can answer now
        os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        results = await asyncio.gather(
            *(renderer.render(turn("hi"), True, {}) for _ in range(2)), return_exceptions=True
        )
        assert all(isinstance(r, RenderError) and r.kind == "timeout" for r in results), results
        assert time.monotonic() - t0 < 10 * (BUDGET.timeout_s + KILL_GRACE_S)  # it ended
    finally:
        for pid in before:
            if alive(pid):
                os.kill(pid, signal.SIGCONT)
    assert await renderer.render(turn("hi"), True, {})  # the replacements serve
    assert not set(pids(renderer)) & set(before)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in before) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not any(alive(p) for p in before)


async def test_one_stuck_render_leaves_the_other_process_serving(renderer):
    stuck = asyncio.create_task(renderer.render(turn("loop"), True, {}))
    await asyncio.sleep(0.05)
    assert await renderer.render(turn("hi"), True, {})  # on the other process, while the loop runs
    assert not stuck.done()
    with pytest.raises(RenderError):
        await stuck


async def test_a_caller_that_goes_away_leaves_the_process_serving(renderer):
    before = set(pids(renderer))
    call = asyncio.create_task(renderer.render(turn("loop"), True, {}))
    await asyncio.sleep(0.1)
    call.cancel()
    await asyncio.sleep(BUDGET.timeout_s + 0.2)  # the render ends at its budget without its caller
    assert set(pids(renderer)) == before
    assert len(await asyncio.gather(*(renderer.render(turn("hi"), True, {}) for _ in range(4)))) == 4


async def test_close_leaves_no_process():
    r = TemplateRenderer(CHATML, SPECIALS, "chatml.jinja", BUDGET)
    await r.start()
    started = pids(r)
    assert len(started) == BUDGET.num_workers and all(alive(p) for p in started)
    await r.close()
    assert not any(alive(p) for p in started)


@pytest.mark.parametrize(
    "template, why",
    [
        (LOOPS_ALWAYS, "did not finish rendering"),
        ("{{ 'a' * 1500000000 }}", "size budget"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed too deep"),
        ("{{ raise_exception('no') }}", "renders none of the start-up test conversations"),
        ("{% if %}", "does not compile"),
    ],
)
async def test_a_template_that_cannot_serve_is_refused_naming_its_file(template, why):
    with pytest.raises(TemplateRefused) as refused:
        await open_renderer(template, SPECIALS, "/models/x/chat_template.jinja", BUDGET)
    assert "/models/x/chat_template.jinja" in str(refused.value) and why in str(refused.value)


async def test_a_template_that_refuses_some_shapes_still_serves(caplog):
    no_system = "{% if messages[0].role == 'system' %}{{ raise_exception('no system turn') }}{% endif %}" + CHATML
    r = await open_renderer(no_system, SPECIALS, "picky.jinja", BUDGET)
    try:
        assert await r.render(turn("hi"), True, {})
    finally:
        await r.close()
    assert "picky.jinja) refuses system, user and assistant turns" in caplog.text
