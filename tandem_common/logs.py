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


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
