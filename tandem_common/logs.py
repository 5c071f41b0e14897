"""Logging set-up for both services: plain text or one JSON object per line."""

from __future__ import annotations

import json
import logging
import sys
import time

_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}

MAX_PRINTED_CHARS = 128  # of a client-chosen string (a request id) in a log line or span


def printable(value: str, limit: int = MAX_PRINTED_CHARS) -> str:
    """A client-chosen string (a request id ...) made safe for text logs and span attributes.

    Newlines, escape sequences and every other non-printable character are escaped as
    Python writes them (``\\n``, ``\\x1b``), so a request id cannot forge a log line or
    colour a terminal; past ``limit`` characters it is cut, with its full length noted.
    """
    if len(value) <= limit and value.isprintable():
        return value
    cut = value[:limit]
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut)
    return text if len(value) <= limit else f"{text}...[{len(value)} chars]"


class JsonFormatter(logging.Formatter):
    """One JSON object per line; ``extra={...}`` fields become top-level keys."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _RESERVED})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(level: str = "INFO", fmt: str = "text", worker: int | None = None) -> None:
    """``worker``: one of several processes of one service (frontend --workers); each line
    then says which, and its pid (text: ``[worker 1 pid 4242]``; JSON: ``worker``, ``pid``)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        tag = " [worker %(worker)s pid %(pid)s]" if worker is not None else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s %(name)s{tag}: %(message)s"))
    if worker is not None:
        handler.addFilter(_WorkerTag(worker))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class _WorkerTag(logging.Filter):
    def __init__(self, worker: int) -> None:
        super().__init__()
        self.worker = worker

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = self.worker
        record.pid = record.process
        return True
