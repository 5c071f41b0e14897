"""Every chat-template render of the server: in render processes it can stop, within a budget.

    TemplateRenderer(source, specials, origin, budget)
        start()   ── num_workers processes (worker.py), each compiles the template once
        render()  ── an idle process ── frame ──▶ render ──▶ text | RenderError (the request's alone)
        close()   ── every process killed and reaped

A render never runs on the event loop: the loop only writes the conversation (JSON) to a
pipe and reads the text back, ~45 µs for an ordinary chat against ~10 µs to render it in
place, and less than a hop to a thread (~70 µs). A render that passes its budget fails its
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
import contextlib
import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from frontend_svc.text.chat_template.worker import HEADER

logger = logging.getLogger(__name__)

KILL_GRACE_S = 0.5  # past the time budget, a process that has not answered is killed
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


class _Process:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def exchange(self, payload: bytes, max_reply: int) -> tuple[bytes, bytes]:
        """(kind, payload) of the answer to one frame; EOFError if the process died."""
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None
        try:
            stdin.write(HEADER.pack(len(payload)))
            stdin.write(payload)
            await stdin.drain()
            (size,) = HEADER.unpack(await stdout.readexactly(HEADER.size))
            if not 1 <= size <= max_reply + 1:
                raise EOFError(f"the render process sent a frame of {size} bytes")
            reply = await stdout.readexactly(size)
        except (asyncio.IncompleteReadError, ConnectionError):
            raise EOFError("it exited or closed its pipe") from None
        return reply[:1], reply[1:]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()

    async def reap(self) -> int | None:
        """Kills, waits for the exit and closes the pipes (a transport left open would be
        closed by the garbage collector, perhaps after its loop)."""
        self.kill()
        code = await self.proc.wait()
        self.proc._transport.close()  # type: ignore[attr-defined] # asyncio's Process has no close()
        return code


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
        self._idle: asyncio.Queue[_Process] = asyncio.Queue()
        self._live: set[_Process] = set()
        self._starting: set[asyncio.Task] = set()
        self._closed = False

    @property
    def what(self) -> str:
        return f"the model's chat template ({self.origin})"

    async def start(self) -> None:
        """Starts every process; RenderError("compile" or "timeout") when the template does
        not compile within the budget, RenderUnavailable when no process starts."""
        processes = await asyncio.gather(*(self._spawn() for _ in range(self.budget.num_workers)))
        for p in processes:
            self._idle.put_nowait(p)

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
        # Shielded: a caller that goes away leaves the render to finish (or be killed at its
        # deadline), and the process to serve on, rather than killing it mid-frame.
        return await asyncio.shield(asyncio.ensure_future(self._exchange(process, payload)))

    async def _exchange(self, process: _Process, payload: bytes) -> tuple[bytes, bytes]:
        try:
            kind, reply = await asyncio.wait_for(
                process.exchange(payload, self.budget.max_bytes + 4096), self.budget.timeout_s + KILL_GRACE_S
            )
        except asyncio.TimeoutError:
            self._replace(process)
            return b"e", json.dumps({"kind": "timeout", "message": "killed"}).encode()
        except EOFError as e:
            self._replace(process)
            return b"e", json.dumps({"kind": "crash", "message": str(e) or "it exited"}).encode()
        self._idle.put_nowait(process)
        return kind, reply

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

    async def _spawn(self) -> _Process:
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "frontend_svc.text.chat_template.worker",
                str(os.getpid()),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                limit=1 << 20,
            )
        except OSError as e:
            raise RenderUnavailable(f"cannot start a chat-template render process: {e}") from e
        process = _Process(proc)
        self._live.add(process)
        try:
            kind, reply = await asyncio.wait_for(
                process.exchange(self._init, 4096), self.budget.timeout_s + KILL_GRACE_S + _START_S
            )
        except BaseException as e:
            self._live.discard(process)
            code = await process.reap()
            if isinstance(e, asyncio.TimeoutError):
                raise self._error(json.dumps({"kind": "timeout", "message": "compiling"}).encode()) from None
            if isinstance(e, EOFError):
                raise RenderUnavailable(f"a chat-template render process exited at start ({code})") from None
            raise
        if kind != b"t":
            self._live.discard(process)
            await process.reap()
            raise self._error(reply)
        return process

    def _replace(self, process: _Process) -> None:
        """Kills ``process`` and starts another in the background, which becomes idle when ready."""
        process.kill()
        if self._closed:
            return
        task = asyncio.create_task(self._restart(process), name="chat-template-restart")
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _restart(self, dead: _Process) -> None:
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
        """Kills and reaps every process; renders still waiting get RenderUnavailable."""
        self._closed = True
        for task in list(self._starting):
            task.cancel()
        await asyncio.gather(*self._starting, return_exceptions=True)
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
