"""One render process, seen from the frontend: a frame out, a frame back, by a deadline.

    RenderProcess.spawn()                python -m ...chat_template.worker, pipes on stdin/stdout
    exchange(payload, deadline_s) ──▶ (kind, reply)  |  Expired (killed at the deadline)  |  Died

The deadline is a timer on the loop that kills the process; nothing else waits on it, so
an exchange costs one write and the reads of the reply: no task, no wait_for (each of
which is another turn of the loop per render). A caller cancelled mid-exchange leaves the
reply to ``finish()``: the read resumes where it stopped (the header may be read already),
so the next frame starts on a frame boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys

from frontend_svc.text.chat_template.worker import HEADER


class Died(Exception):
    """The process ended or broke the protocol; it must not be given another frame."""


class Expired(Died):
    """The deadline passed and the process was killed."""


class RenderProcess:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.expired = False
        self._reply_size: int | None = None  # the header of a reply read, its body not yet
        self._timer: asyncio.TimerHandle | None = None

    @classmethod
    async def spawn(cls) -> RenderProcess:
        """A new process (fork+exec: never a bare fork of this threaded process); OSError if none starts."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "frontend_svc.text.chat_template.worker",
            str(os.getpid()),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=1 << 20,
        )
        return cls(proc)

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def exchange(self, payload: bytes, max_reply: int, deadline_s: float) -> tuple[bytes, bytes]:
        """Sends one frame and reads the answer: (kind, reply). Expired when ``deadline_s``
        passes first (the process is killed then), Died when it ends or misbehaves."""
        stdin = self.proc.stdin
        assert stdin is not None
        self._timer = asyncio.get_running_loop().call_later(deadline_s, self._expire)
        try:
            stdin.write(HEADER.pack(len(payload)) + payload)  # one write, one wake-up of the process
        except (ConnectionError, RuntimeError):
            self._done()
            raise self._death() from None
        return await self.finish(max_reply)

    async def finish(self, max_reply: int) -> tuple[bytes, bytes]:
        """Reads the reply of the frame sent last (again, after a cancelled read)."""
        stdout = self.proc.stdout
        assert stdout is not None
        try:
            if self._reply_size is None:
                (size,) = HEADER.unpack(await stdout.readexactly(HEADER.size))
                if not 1 <= size <= max_reply + 1:
                    self.kill()
                    raise Died(f"it sent a frame of {size} bytes")
                self._reply_size = size
            reply = await stdout.readexactly(self._reply_size)
        except (asyncio.IncompleteReadError, ConnectionError):
            self._done()
            raise self._death() from None
        except asyncio.CancelledError:
            raise  # the timer stays armed: finish() resumes the read, or the process is killed
        except Died:
            self._done()
            raise
        self._reply_size = None
        self._done()
        return reply[:1], reply[1:]

    def _done(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self.expired = True
        self.kill()

    def _death(self) -> Died:
        return Expired("killed at its deadline") if self.expired else Died("it exited or closed its pipe")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()

    async def reap(self) -> int | None:
        """Kills, waits for the exit and closes the pipes (a transport left open would be
        closed by the garbage collector, perhaps after its loop)."""
        self._done()
        self.kill()
        code = await self.proc.wait()
        self.proc._transport.close()  # type: ignore[attr-defined] # asyncio's Process has no close()
        return code
