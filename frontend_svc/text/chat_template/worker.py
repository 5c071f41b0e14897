"""The render process: one chat template, compiled once, rendering one conversation at a time.

    python -m frontend_svc.text.chat_template.worker PARENT_PID      (started by renderer.py)

    stdin  ── frame: {"template", "specials", "max_chars", "timeout_s", "headroom_bytes"}  (once)
           ── frame: {"messages", "add_generation_prompt", "variables"}                   (per render)
    stdout ◀─ frame: b"t" + the text (UTF-8)  |  b"e" + {"kind", "message"} (JSON)

A frame is a 4-byte little-endian length and that many bytes. Both directions carry data
only (JSON and UTF-8, never pickle): the parent trusts nothing this process says beyond
its length and kind, since the template it runs is the model's code.

Its bounds, each an error frame of its own kind, after which the process serves on:
    timeout    an interval timer (SIGALRM) raises at ``timeout_s`` between two bytecodes
    size       chat_template/sandbox.py refuses a widening operation; the text is measured
    memory     RLIMIT_AS: the address space at start plus ``headroom_bytes`` (MemoryError)
    recursion  RecursionError (a recursive macro, nested input)
    template   any other failure of the template (raise_exception, a wrong type ...)
    compile    the template does not compile (first frame only)
A C call that runs long (one huge operation) delays SIGALRM; the parent kills the process
at its own deadline then. The process dies with its parent (PR_SET_PDEATHSIG) and ignores
SIGINT (a terminal's ^C is the parent's to handle); EOF on stdin ends it.
"""

from __future__ import annotations

import json
import resource
import signal
import struct
import sys
from typing import Any, BinaryIO

import jinja2

from frontend_svc.text.chat_template.sandbox import BudgetError, ChatSandbox, template_variables
from tandem_common.parent_death import die_with_parent

HEADER = struct.Struct("<I")


class RenderTimeout(BaseException):
    """Raised by SIGALRM inside a render; a BaseException so that no handler on the way
    (jinja2's, the template's filters') takes it for an error of the template."""


def _on_alarm(_signum: int, _frame: Any) -> None:
    raise RenderTimeout


def read_frame(stream: BinaryIO) -> bytes | None:
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (size,) = HEADER.unpack(head)
    body = stream.read(size)
    return body if len(body) == size else None


def write_frame(stream: BinaryIO, kind: bytes, payload: bytes) -> None:
    stream.write(HEADER.pack(len(payload) + 1) + kind)
    stream.write(payload)
    stream.flush()


def _error(kind: str, message: str) -> tuple[bytes, bytes]:
    return b"e", json.dumps({"kind": kind, "message": message[:2000]}).encode()


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


class Worker:
    def __init__(self, init: dict[str, Any]) -> None:
        self.specials: dict[str, str] = init["specials"]
        self.max_chars: int = init["max_chars"]
        self.timeout_s: float = init["timeout_s"]
        self.headroom_bytes: int = init["headroom_bytes"]
        self.template: jinja2.Template | None = None
        self.init_template: str = init["template"]

    def start(self) -> tuple[bytes, bytes]:
        """Limits the address space, then compiles the template under the same timer as a
        render (jinja2 evaluates constant expressions as it compiles)."""
        if sys.platform.startswith("linux"):
            limit = _vm_bytes() + self.headroom_bytes
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            self.template = self._timed(lambda: ChatSandbox(self.max_chars).from_string(self.init_template))
        except RenderTimeout:
            return _error("timeout", "compiling the template did not finish within the budget")
        except MemoryError:
            return _error("memory", "ran out of memory compiling the template")
        except (jinja2.TemplateError, RecursionError) as e:
            return _error("compile", str(e))
        return b"t", b""

    def render(self, request: dict[str, Any]) -> tuple[bytes, bytes]:
        assert self.template is not None
        template = self.template
        try:
            variables = template_variables(
                self.specials, request["messages"], request["add_generation_prompt"], request["variables"]
            )
            text = self._timed(lambda: template.render(**variables))
            if len(text) > self.max_chars:  # a character is at least one byte
                return _error("size", f"the text has {len(text)} characters")
            data = text.encode("utf-8", "surrogatepass")
            if len(data) > self.max_chars:
                return _error("size", f"the text has {len(data)} bytes")
            return b"t", data
        except RenderTimeout:
            return _error("timeout", "did not finish")
        except BudgetError as e:
            return _error("size", str(e))
        except MemoryError:
            return _error("memory", "ran out of memory")
        except RecursionError as e:
            return _error("recursion", str(e))
        except Exception as e:  # noqa: BLE001 - the template's own failure, told to its request
            message = str(e) if isinstance(e, jinja2.TemplateError) else repr(e)
            return _error("template", message)

    def _timed(self, fn):
        try:
            signal.setitimer(signal.ITIMER_REAL, self.timeout_s)
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)


def main(argv: list[str]) -> int:
    arm = die_with_parent(int(argv[0]))
    if arm is not None:
        arm()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGALRM, _on_alarm)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # the pipe carries frames only
    first = read_frame(stdin)
    if first is None:
        return 0
    worker = Worker(json.loads(first))
    kind, payload = worker.start()
    write_frame(stdout, kind, payload)
    if kind != b"t":
        return 0
    while (frame := read_frame(stdin)) is not None:
        write_frame(stdout, *_answer(worker, frame))
    return 0


def _answer(worker: Worker, frame: bytes) -> tuple[bytes, bytes]:
    try:
        request = json.loads(frame)
    except (ValueError, RecursionError) as e:
        return _error("template", f"the render request is not readable: {e}")
    except MemoryError:
        return _error("memory", "ran out of memory reading the request")
    return worker.render(request)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
