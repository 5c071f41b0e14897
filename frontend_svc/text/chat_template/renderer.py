"""Every chat-template render of the server: in render processes it can stop, within a budget.

    TemplateRenderer(source, specials, origin, budget)
        start()   ── num_workers processes (worker.py), each compiles the template once
        render()  ── an idle process ── frame ──▶ render ──▶ text | RenderError (the request's alone)
        close()   ── every process killed and reaped

A render never runs on the event loop: the loop only writes the conversation (JSON) to a
pipe and reads the text back. For an ordinary chat that is ~45 µs on an idle 2-core
machine (100-170 µs with the cores oversubscribed) against ~11 µs to render it in place,
and less than a hop to a thread (~70 µs). A render that passes its budget fails its
own request (RenderError, kind and message for the client) and nothing else: the process
stops it itself (timeout, size, memory, recursion), or, stuck in one long C call, is
killed at the budget plus KILL_GRACE_S; a new one takes its place in the background
while the others serve on. Each process renders one conversation at a time, so a kill
loses only the render that caused it; with ``num_workers`` processes, that many renders
stuck at once delay the next ones by at most the time budget.

Processes are plain subprocesses (fork+exec from the event loop's thread, never a bare
fork of this threaded process), die with the frontend (PR_SET_PDEATHSIG) and are killed
by close().
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from frontend_svc.text.chat_template.process import Died, Expired, RenderProcess

logger = logging.getLogger(__name__)

KILL_GRACE_S = 0.5  # past the time budget, a process that has not answered is killed
# ... plus the time to move the conversation there and its text back (JSON both ways, the
# pipe), which the process's own timer does not count: a 16 MiB conversation, 28 MB of
# JSON, took 0.9 s on a loaded 2-core machine, of which 0.04 s was the render.
TRANSFER_BYTES_PER_S = 8 << 20
OFF_LOOP_CHARS = 1 << 16  # conversations and texts larger than this are (de)serialised on a thread
MEMORY_BASE_BYTES = 256 << 20  # a render process's address space: what it has at start, plus this,
MEMORY_PER_BUDGET_BYTE = 8  # plus this many times --chat-template-max-bytes (input, output and copies)


@dataclass(frozen=True)
class TemplateBudget:
    """What one render may take (--chat-template-timeout-s, --chat-template-max-bytes) and
    how many render processes a frontend process keeps (--chat-template-workers)."""

    timeout_s: float = 2.0
    max_bytes: int = 32 << 20
    num_workers: int = 2

    @property
    def headroom_bytes(self) -> int:
        return MEMORY_BASE_BYTES + MEMORY_PER_BUDGET_BYTE * self.max_bytes


class RenderError(ValueError):
    """A render failed; ``kind`` is one of worker.py's, the message says what happened."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind

    @property
    def over_budget(self) -> bool:
        """The template, not the conversation, is at fault: it cannot serve this input in its budget."""
        return self.kind in ("timeout", "size", "memory", "recursion", "crash")


class RenderUnavailable(RuntimeError):
    """No render process can be started (the machine refuses processes or memory)."""


class TemplateRenderer:
    """One template's render processes. ``origin`` names where the template came from in
    every message (a file, or a file and the engines that served it)."""

    def __init__(self, source: str, specials: dict[str, str], origin: str, budget: TemplateBudget) -> None:
        self.origin = origin
        self.budget = budget
        self._init = json.dumps(
            {
                "template": source,
                "specials": specials,
                "max_chars": budget.max_bytes,
                "timeout_s": budget.timeout_s,
                "headroom_bytes": budget.headroom_bytes,
            }
        ).encode()
        self._idle: asyncio.LifoQueue[RenderProcess] = asyncio.LifoQueue()  # the warmest process first
        self._live: set[RenderProcess] = set()
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._max_reply = budget.max_bytes + 4096  # the text, or an error's JSON

    @property
    def what(self) -> str:
        return f"the model's chat template ({self.origin})"

    async def start(self) -> None:
        """Starts every process; RenderError("compile" or "timeout") when the template does
        not compile within the budget, RenderUnavailable when no process starts."""
        # Every start ends (a failed one reaps its own process) before this returns.
        started = await asyncio.gather(*(self._spawn() for _ in range(self.budget.num_workers)), return_exceptions=True)
        for outcome in started:
            if isinstance(outcome, RenderProcess):
                self._idle.put_nowait(outcome)
        failure = next((e for e in started if isinstance(e, BaseException)), None)
        if failure is not None:
            raise failure

    async def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, variables: dict[str, Any], size: int = 0
    ) -> str:
        """The template's text for this conversation, or RenderError. ``size`` (characters
        of the conversation) moves larger ones' JSON off the loop."""
        request = {"messages": messages, "add_generation_prompt": add_generation_prompt, "variables": variables}
        try:
            payload = await asyncio.to_thread(_dumps, request) if size > OFF_LOOP_CHARS else _dumps(request)
        except (ValueError, TypeError, RecursionError) as e:
            raise RenderError("input", f"the conversation cannot be given to the chat template: {e}") from None
        kind, reply = await self._call(payload)
        if kind == b"t":
            return await asyncio.to_thread(_text, reply) if len(reply) > OFF_LOOP_CHARS else _text(reply)
        raise self._error(reply)

    async def _call(self, payload: bytes) -> tuple[bytes, bytes]:
        if self._closed:
            raise RenderUnavailable("the frontend is shutting down")
        process = await self._idle.get()
        deadline_s = self.budget.timeout_s + KILL_GRACE_S + 2 * len(payload) / TRANSFER_BYTES_PER_S
        try:
            kind, reply = await process.exchange(payload, self._max_reply, deadline_s)
        except Died as e:
            self._replace(process)
            return b"e", json.dumps(
                {"kind": "timeout" if isinstance(e, Expired) else "crash", "message": str(e)}
            ).encode()
        except asyncio.CancelledError:
            # The caller went away: the render finishes (or is killed at its deadline) without
            # it, and the process then serves on rather than being killed mid-frame.
            self._background(self._finish(process))
            raise
        self._idle.put_nowait(process)
        return kind, reply

    async def _finish(self, process: RenderProcess) -> None:
        try:
            await process.finish(self._max_reply)
        except Died:
            self._replace(process)
            return
        self._idle.put_nowait(process)

    def _error(self, reply: bytes) -> RenderError:
        try:
            error = json.loads(reply)
            kind, detail = str(error["kind"]), str(error["message"])
        except (ValueError, KeyError, TypeError):
            kind, detail = "crash", "an unreadable answer"
        b = self.budget
        messages = {
            "timeout": f"{self.what} did not finish rendering this conversation within its time budget of "
            f"{b.timeout_s:g} s (--chat-template-timeout-s)",
            "size": f"{self.what} made more text than its size budget of {b.max_bytes} bytes "
            f"(--chat-template-max-bytes): {detail}",
            "memory": f"{self.what} needed more memory than its budget, which --chat-template-max-bytes "
            f"({b.max_bytes}) sets: {detail}",
            "recursion": f"{self.what} recursed too deep on this conversation (a recursive macro, or input nested "
            f"too deep): {detail}",
            "crash": f"{self.what} made its render process fail on this conversation ({detail})",
            "compile": f"{self.what} does not compile: {detail}",
            "template": f"chat template error: {detail}",
        }
        return RenderError(kind, messages.get(kind, f"{self.what} failed: {detail}"))

    # -- processes

    async def _spawn(self) -> RenderProcess:
        try:
            process = await RenderProcess.spawn()
        except OSError as e:
            raise RenderUnavailable(f"cannot start a chat-template render process: {e}") from e
        self._live.add(process)
        try:
            kind, reply = await process.exchange(self._init, 4096, self.budget.timeout_s + KILL_GRACE_S + _START_S)
        except BaseException as e:
            self._live.discard(process)
            code = await process.reap()
            if isinstance(e, Expired):
                raise self._error(json.dumps({"kind": "timeout", "message": "compiling"}).encode()) from None
            if isinstance(e, Died):
                raise RenderUnavailable(f"a chat-template render process exited at start ({code})") from None
            raise
        if kind != b"t":
            self._live.discard(process)
            await process.reap()
            raise self._error(reply)
        return process

    def _replace(self, process: RenderProcess) -> None:
        """Kills ``process`` and starts another in the background, which becomes idle when ready."""
        process.kill()
        if not self._closed:
            self._background(self._restart(process))

    def _background(self, work) -> None:
        task = asyncio.create_task(work, name="chat-template-process")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restart(self, dead: RenderProcess) -> None:
        await dead.reap()
        self._live.discard(dead)
        delay = 0.1
        while not self._closed:
            try:
                self._idle.put_nowait(await self._spawn())
                return
            except (RenderUnavailable, RenderError) as e:
                logger.error("cannot restart a chat-template render process: %s; retrying in %.1f s", e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def close(self) -> None:
        """Kills and reaps every process (once the calls have ended); later renders get RenderUnavailable."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        live, self._live = list(self._live), set()  # the dead ones a restart had not reaped too
        await asyncio.gather(*(p.reap() for p in live), return_exceptions=True)


_START_S = 10.0  # a process's own start (Python, jinja2) before the template compiles: seconds on a busy machine


def _dumps(request: dict[str, Any]) -> bytes:
    return json.dumps(request).encode()


def _text(reply: bytes) -> str:
    return reply.decode("utf-8", "surrogatepass")


class NoChatTemplate:
    """The renderer of a model without a chat template (planning refuses chats before it is asked)."""

    what = "the model's chat template (none)"

    async def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, variables: dict[str, Any], size: int = 0
    ) -> str:
        raise RenderError("template", "the model has no chat template; send text or token_ids instead")

    async def close(self) -> None:
        pass


ChatRenderer = TemplateRenderer | NoChatTemplate
