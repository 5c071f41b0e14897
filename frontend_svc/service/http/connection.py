"""HTTP/1.1 connections bounded as nginx bounds them: uvicorn's h11 protocol with deadlines and caps.

    accept ── past --http-max-connections, or the address's --http-max-connections-per-address ──▶ 503, closed
      │
      ▼
    idle ── first byte ──▶ head ── head parsed ──▶ body ── body read ──▶ answering ── response sent ──┐
      ▲   (--http-idle-      (--http-header-         (--http-body-            (no read deadline)        │
      │    timeout-s)          timeout-s)              timeout-s)                                       │
      └────────────────────────────────────── keep-alive ◀─────────────────────────────────────────────┘

    idle past its deadline           closed (nothing was asked)
    head or body past its deadline   408, closed; a request whose body was being read sees a disconnect
    a head over --http-max-header-bytes or with more than --http-max-header-fields fields   431, closed
    output waiting on a client that reads nothing for --stalled-client-timeout-s   closed at once

Each phase's deadline runs from the moment the phase begins, not from the last byte: a
head or body sent one byte at a time (slowloris) gets no more time than a silent one.
The send deadline is gRPC's stalled-client rule on the same flag: it runs while the
socket's send buffer is full and the transport above its high-water mark (asyncio's
``pause_writing``), that is while the client reads nothing; closing the connection makes
the request's handler see a disconnect, which aborts its engine requests.

The mechanism is uvicorn's own: ``H11Protocol`` subclassed (``uvicorn.Config(http=...)``
takes a protocol class), h11 parsing everything, and the head limits raised from h11's
``next_event`` (whose over-long-buffer error already carries ``error_status_hint`` 431,
which uvicorn answers as a 400). A timer per connection, re-armed only when the phase
changes: nothing runs per byte or per chunk. Connections are counted per process (each of
``--workers`` has its own counts) and per client address (the host, without the port).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import resource
from collections import Counter
from dataclasses import dataclass
from typing import ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from frontend_svc.service.http import sse
from frontend_svc.service.http.errors import HttpError

logger = logging.getLogger(__name__)

RESERVED_FILE_DESCRIPTORS = 256  # beyond the connections: engine channels, files, the metrics server


@dataclass(frozen=True)
class ConnectionLimits:
    """What one HTTP connection may hold, and for how long (0: no limit, for the caps and
    the send deadline)."""

    idle_timeout_s: float = 20.0  # --http-idle-timeout-s: before the first request and between requests
    header_timeout_s: float = 30.0  # --http-header-timeout-s: from the head's first byte to its end
    body_timeout_s: float = 60.0  # --http-body-timeout-s: from the head's end to the body's end
    send_timeout_s: float = 30.0  # --stalled-client-timeout-s: output waiting on a client that reads nothing
    max_connections: int = 4096  # --http-max-connections (per process)
    max_connections_per_address: int = 1024  # --http-max-connections-per-address
    max_header_bytes: int = 64 * 1024  # --http-max-header-bytes: request line and headers
    max_header_fields: int = 128  # --http-max-header-fields

    def describe(self) -> str:
        """One line for the start-up log."""
        return (
            f"idle {self.idle_timeout_s:g} s, head {self.header_timeout_s:g} s, body {self.body_timeout_s:g} s, "
            f"stalled client {self.send_timeout_s:g} s; at most {self.max_connections or 'any number of'} "
            f"connections, {self.max_connections_per_address or 'any number'} per address; heads of at most "
            f"{self.max_header_bytes} bytes and {self.max_header_fields} fields"
        )


class OpenConnections:
    """The connections one HTTP server holds, in all and per client address."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.num_open = 0
        self._by_address: Counter[str] = Counter()

    def admit(self, address: str) -> str | None:
        """Counts a new connection from ``address``; or, past a cap, says why not (and counts nothing)."""
        limits = self.limits
        if limits.max_connections and self.num_open >= limits.max_connections:
            return (
                f"this server holds its limit of {limits.max_connections} open connections "
                "(--http-max-connections); retry later or on another replica"
            )
        if limits.max_connections_per_address and self._by_address[address] >= limits.max_connections_per_address:
            return (
                f"this client address already holds {limits.max_connections_per_address} open connections, "
                "its cap (--http-max-connections-per-address); reuse connections (keep-alive) or close some"
            )
        self.num_open += 1
        self._by_address[address] += 1
        return None

    def release(self, address: str) -> None:
        self.num_open -= 1
        self._by_address[address] -= 1
        if not self._by_address[address]:
            del self._by_address[address]


class Phase(enum.Enum):
    IDLE = "idle"
    HEAD = "head"
    BODY = "body"
    ANSWERING = "answering"


class _Head(h11.Connection):
    """h11's server side with the head's limits. h11 refuses a head over ``max_bytes`` only
    while it is incomplete (a RemoteProtocolError hinting 431); a head that arrives whole
    in one read is parsed whatever its size. So a parsed head is measured too, and one over
    ``max_bytes`` or with more than ``max_fields`` fields is refused the same way. The
    refusal is kept for the answer."""

    def __init__(self, max_bytes: int, max_fields: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_bytes)
        self.max_bytes = max_bytes
        self.max_fields = max_fields
        self.refusal: h11.RemoteProtocolError | None = None

    def next_event(self):
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as e:
            self.refusal = e
            raise
        if type(event) is h11.Request:
            problem = self._over_limits(event)
            if problem is not None:
                self.refusal = h11.RemoteProtocolError(problem, error_status_hint=431)
                raise self.refusal
        return event

    def _over_limits(self, request: h11.Request) -> str | None:
        if len(request.headers) > self.max_fields:
            return (
                f"the request has {len(request.headers)} header fields, more than this server's limit of "
                f"{self.max_fields} (--http-max-header-fields)"
            )
        # The head as parsed: "METHOD TARGET HTTP/1.1\r\n" and "name: value\r\n" per field.
        size = len(request.method) + len(request.target) + 12 + sum(len(n) + len(v) + 4 for n, v in request.headers)
        if size > self.max_bytes:
            return _too_large(self.max_bytes)
        return None


def _too_large(max_bytes: int) -> str:
    return (
        f"the request line and headers are larger than this server's limit of {max_bytes} bytes "
        "(--http-max-header-bytes)"
    )


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the module docstring's deadlines and caps. Made per
    server by ``protocol_class``, which sets the two class attributes."""

    limits: ClassVar[ConnectionLimits]
    open_connections: ClassVar[OpenConnections]

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head = self.conn = _Head(self.limits.max_header_bytes, self.limits.max_header_fields)
        self.phase = Phase.IDLE
        self._timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._address: str | None = None  # counted in ``connections`` while set

    # -- connection ---------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        address = self.client[0] if self.client else ""
        refusal = self.open_connections.admit(address)
        if refusal is not None:
            logger.debug("HTTP connection from %s refused: %s", address, refusal)
            self._answer(503, refusal, retry_after=True)
            return
        self._address = address
        self._enter(Phase.IDLE)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        if self._address is not None:
            self.open_connections.release(self._address)
            self._address = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._address is None:  # refused: its answer is on its way, the rest is not read
            return
        if self.phase is Phase.IDLE:
            self._enter(Phase.HEAD)
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    # -- phases -------------------------------------------------------------------------------

    def _follow(self) -> None:
        """Moves to the phase h11's state of the client's side tells."""
        if self.transport.is_closing():
            self._cancel_timers()
            return
        state = self.conn.their_state
        if state is h11.IDLE:  # between requests: bytes of the next head may be here already
            phase = Phase.HEAD if self.phase is Phase.HEAD or self.conn.trailing_data[0] else Phase.IDLE
        elif state is h11.SEND_BODY:
            phase = Phase.BODY
        else:
            phase = Phase.ANSWERING
        if phase is not self.phase:
            self._enter(phase)

    def _enter(self, phase: Phase) -> None:
        self.phase = phase
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        timeout = {
            Phase.IDLE: self.limits.idle_timeout_s,
            Phase.HEAD: self.limits.header_timeout_s,
            Phase.BODY: self.limits.body_timeout_s,
        }.get(phase)
        if timeout:
            self._timer = self.loop.call_later(timeout, self._expired, phase)

    def _expired(self, phase: Phase) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if phase is Phase.IDLE:
            logger.debug("HTTP connection from %s idle for %g s: closed", self._address, self.limits.idle_timeout_s)
            self.transport.close()
            return
        if phase is Phase.HEAD:
            what = (
                f"the request's head did not arrive within {self.limits.header_timeout_s:g} s (--http-header-timeout-s)"
            )
        else:
            what = f"the request's body did not arrive within {self.limits.body_timeout_s:g} s (--http-body-timeout-s)"
        logger.debug("HTTP connection from %s: %s; closed", self._address, what)
        cycle = self.cycle
        if phase is Phase.BODY and cycle is not None:
            if not cycle.response_complete:  # the handler waiting for the body sees a disconnect
                cycle.disconnected = True
                cycle.message_event.set()
            if cycle.response_started:  # it answered without the body (a 401): no second answer
                self.transport.close()
                return
        self._answer(408, what + "; send the whole request at once")

    # -- answers ------------------------------------------------------------------------------

    def send_400_response(self, msg: str) -> None:
        """A head h11 refused: 431 for one over a head limit, else 400 with h11's reason."""
        refusal = self._head.refusal
        if refusal is not None and refusal.error_status_hint == 431:
            message = str(refusal)
            if message == "Receive buffer too long":  # h11's own words for an incomplete head
                message = _too_large(self.limits.max_header_bytes)
            self._answer(431, message)
        else:
            self._answer(400, f"the request is not valid HTTP/1.1: {refusal or msg}")

    def _answer(self, status: int, message: str, *, retry_after: bool = False) -> None:
        """Writes a whole response (OpenAI's error shape) and closes the connection. Raw bytes:
        h11 can send no response to a request whose head it has not parsed."""
        body = sse.dumps(HttpError(status, message).openai_body())
        head = [
            f"HTTP/1.1 {status} {_REASONS[status]}",
            "content-type: application/json",
            f"content-length: {len(body)}",
            "connection: close",
        ]
        if retry_after:
            head.append("retry-after: 1")
        self.transport.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        self.transport.close()

    # -- the send deadline --------------------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.limits.send_timeout_s and self._send_timer is None:
            self._send_timer = self.loop.call_later(self.limits.send_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _stalled(self) -> None:
        self._send_timer = None
        logger.info(
            "HTTP client %s read none of its response for %g s while output waited (--stalled-client-timeout-s): "
            "connection closed, its requests aborted",
            self._address,
            self.limits.send_timeout_s,
        )
        self.transport.abort()  # close() would wait for the buffer to drain: it never would

    def _cancel_timers(self) -> None:
        for timer in (self._timer, self._send_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._send_timer = None


_REASONS = {
    400: "Bad Request",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


def protocol_class(limits: ConnectionLimits) -> type[BoundedH11Protocol]:
    """A protocol class for one server: its limits and its count of open connections."""
    return type(
        "HttpConnection", (BoundedH11Protocol,), {"limits": limits, "open_connections": OpenConnections(limits)}
    )


def reserve_file_descriptors(max_connections: int) -> str | None:
    """Raises this process's open-file limit to hold ``max_connections`` sockets and the
    rest, as far as the hard limit allows; a warning when it cannot (accept() would then
    fail before the connection limit is reached), else None."""
    if not max_connections:
        return None
    need = max_connections + RESERVED_FILE_DESCRIPTORS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return None
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        target = soft
    if target >= need:
        return None
    return (
        f"the open-file limit is {target} (hard limit {hard}), too few for --http-max-connections "
        f"{max_connections}: raise it (ulimit -n {need}) or lower --http-max-connections"
    )
