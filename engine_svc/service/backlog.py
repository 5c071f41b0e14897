"""A stream's unsent outputs: merged per request, handed out in bounded messages.

    engine thread ── put(outputs, stats) ──▶ StreamBacklog ── take() ──▶ stream session: one StreamResponse
                 ◀── True: "pause my requests" ─┘     └── Batch.resume: "they may run again"

A reader that keeps up takes each step's outputs as they come, one message per step. A
reader that falls behind (its frontend stalls, the network is slow) finds a backlog: the
outputs of one request are merged into one, and ``take()`` hands out at most
``max_outputs`` of them and at most ``max_message_bytes``, splitting the output of a
request whose backlog alone is larger (prompt logprobs first, then tokens; only the last
piece carries the finish). Beyond ``pause_bytes`` of backlog, ``put`` answers True and
the engine pauses the stream's requests, so the backlog stops growing; ``take()`` says
when it is back to a quarter of that, and the stream session resumes them.

Prefix-cache events (a stream subscribed to them) wait here too, in their batches of at
most ``max_hashes`` hashes (the engine loop cuts them so): ``take()`` hands out the
oldest batches first, as many as fit ``max_hashes`` together, and no outputs while any
are left, so a request's blocks are announced no later than its outputs. They count in
the backlog's size like outputs do.

Sizes are upper bounds of the serialized protobuf (``RequestOutput`` inside
``StreamResponse``, every varint counted at its widest), computed from plain values: no
protobuf here. A message built from one ``take()`` is never larger than
``max_message_bytes`` plus ``MESSAGE_OVERHEAD_BYTES`` (the load figures), and one output,
however long, always fits a message of 64 KiB or more.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine_svc.outputs import EngineOutput, EngineStats, RejectedAdd
from engine_svc.types import Logprob, RequestError
from tandem_common.kv_events import KvEvent, num_hashes

MAX_MESSAGE_BYTES = 4 << 20  # one message, at most (and at most a quarter of the gRPC limit)
MAX_OUTPUTS_PER_MESSAGE = 256
DEFAULT_PAUSE_BYTES = 16 << 20  # --stream-backlog-bytes
MESSAGE_OVERHEAD_BYTES = 64  # the EngineLoad of a message, at its widest
# Prefix-cache events per message: at most this many block hashes (and at most the
# message's byte bound again: a hash takes 34 bytes on the wire, 40 leaves room for the
# events around them). 4096 hashes are about 140 KiB; a snapshot of a large cache (1 GiB
# of KV at 16 tokens a block can be 65k blocks) spans several messages.
KV_EVENTS_MAX_HASHES = 4096
KV_HASH_WIRE_BYTES = 40

# Widest encodings: a tag is 1 byte (field numbers < 16), a uint32 or enum varint 5, a
# float 4, a length prefix 5 (messages here stay far below 2**32 bytes).
_FIELD = 1 + 5  # tag + varint
_LEN = 1 + 5  # tag + length prefix of a string, a nested message or a packed field
_TOP = _LEN + _FIELD + 1 + 4  # one TopLogprob: token id, logprob
_TOKEN_LOGPROB = _LEN + _FIELD + (1 + 4) + _FIELD  # one TokenLogprob without its top entries
_TOKEN = 5  # one packed uint32
# finish_reason, stop_token_id, num_prompt_tokens, num_cached_tokens: counted whether set or not.
_FIXED = 4 * _FIELD


def logprob_bytes(lp: Logprob) -> int:
    return _TOKEN_LOGPROB + _TOP * len(lp.top)


def _str_bytes(s: str) -> int:
    return _LEN + len(s.encode())


def _error_bytes(error: RequestError | None) -> int:
    if error is None:
        return 0
    return _LEN + _FIELD + _str_bytes(error.message) + _str_bytes(error.field)


def _head_bytes(request_id: str) -> int:
    """What every piece of one request's output costs besides its items: the entry in
    ``outputs``, the request id, the packed-tokens prefix and the fixed fields."""
    return _LEN + _str_bytes(request_id) + _LEN + _FIXED


def output_bytes(out: EngineOutput) -> int:
    """An upper bound of ``out``'s serialized size inside a StreamResponse."""
    return (
        _head_bytes(out.request_id)
        + _TOKEN * len(out.new_token_ids)
        + sum(map(logprob_bytes, out.logprobs))
        + sum(map(logprob_bytes, out.prompt_logprobs))
        + _error_bytes(out.error)
    )


def rejected_bytes(rejected: RejectedAdd) -> int:
    return _LEN + _str_bytes(rejected.request_id) + _error_bytes(rejected.error)


@dataclass
class Batch:
    """What one StreamResponse carries."""

    outputs: list[EngineOutput] = field(default_factory=list)
    rejected: list[RejectedAdd] = field(default_factory=list)
    kv_events: list[KvEvent] = field(default_factory=list)
    stats: EngineStats | None = None  # the latest snapshot (the message's load figures)
    done: bool = False  # the stream is complete: nothing pending and nothing more will come
    resume: bool = False  # this take brought the backlog down to the resume level


class StreamBacklog:
    """Outputs the engine produced for one stream that its reader has not taken yet.

    ``put`` and ``finish`` run on the engine thread, ``take`` on the gRPC event
    loop; a lock guards the state, and each call holds it only for its own work.
    """

    def __init__(
        self,
        *,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        max_outputs: int = MAX_OUTPUTS_PER_MESSAGE,
        pause_bytes: int = DEFAULT_PAUSE_BYTES,
        max_hashes: int = KV_EVENTS_MAX_HASHES,
    ) -> None:
        self.max_message_bytes = max_message_bytes
        self.max_hashes = max_hashes
        self.max_outputs = max_outputs
        self.pause_bytes = pause_bytes
        self.resume_bytes = pause_bytes // 4
        self._lock = threading.Lock()
        self._pending: dict[str, EngineOutput] = {}  # by request id, in order of first output
        self._sizes: dict[str, int] = {}  # output_bytes of each pending output
        self._merged: set[str] = set()  # pending outputs that are the backlog's own copies
        self._rejected: list[RejectedAdd] = []
        self._kv_batches: list[list[KvEvent]] = []
        self._stats: EngineStats | None = None
        self._finished = False
        self._bytes = 0

    @property
    def num_bytes(self) -> int:
        """The backlog's size (upper bound of its serialized outputs)."""
        return self._bytes

    @property
    def over_read_limit(self) -> bool:
        """Above twice the pause bound: the stream's control messages should wait too."""
        return self._bytes > 2 * self.pause_bytes

    # -- the engine thread ---------------------------------------------------------------

    def put(self, items: Sequence[EngineOutput | RejectedAdd], stats: EngineStats) -> bool:
        """Queue one turn's outputs; True when the backlog is beyond ``pause_bytes``."""
        with self._lock:
            self._stats = stats
            for item in items:
                if isinstance(item, RejectedAdd):
                    self._rejected.append(item)
                    self._bytes += rejected_bytes(item)
                else:
                    self._add(item)
            return self._bytes > self.pause_bytes

    def put_events(self, events: list[KvEvent], stats: EngineStats) -> None:
        """Queue one batch of prefix-cache events (at most ``max_hashes`` hashes)."""
        with self._lock:
            self._stats = stats
            self._kv_batches.append(events)
            self._bytes += KV_HASH_WIRE_BYTES * num_hashes(events)

    def finish(self, stats: EngineStats) -> None:
        """The stream is complete: once the backlog is taken, ``take`` says ``done``."""
        with self._lock:
            self._stats = stats
            self._finished = True

    def _add(self, out: EngineOutput) -> None:
        size = output_bytes(out)
        request_id = out.request_id
        held = self._pending.get(request_id)
        if held is None:
            self._pending[request_id] = out
            self._sizes[request_id] = size
            self._bytes += size
            return
        if request_id not in self._merged:  # never change an output the engine handed over
            held = self._pending[request_id] = held.copy()
            self._merged.add(request_id)
        held.merge(out)
        # One head for the merged output, in both counts: ``_bytes`` is always the sum of
        # ``_sizes`` (and of the rejected adds and events), so a take() gives back exactly what
        # put() counted and the backlog returns to 0 once emptied, however often it merged.
        merged_size = size - _head_bytes(request_id)
        self._sizes[request_id] += merged_size
        self._bytes += merged_size

    # -- the reader ----------------------------------------------------------------------

    def take(self) -> Batch:
        """At most one message's worth, oldest first; an empty batch when nothing is due."""
        with self._lock:
            before = self._bytes
            batch = Batch(stats=self._stats)
            while self._kv_batches and (
                not batch.kv_events or num_hashes(batch.kv_events) + num_hashes(self._kv_batches[0]) <= self.max_hashes
            ):
                events = self._kv_batches.pop(0)
                batch.kv_events.extend(events)
                self._bytes -= KV_HASH_WIRE_BYTES * num_hashes(events)
            if self._kv_batches:  # outputs only once their blocks are announced
                batch.resume = before > self.resume_bytes >= self._bytes
                return batch
            budget = self.max_message_bytes
            while self._rejected and rejected_bytes(self._rejected[0]) <= budget:
                rejected = self._rejected.pop(0)
                budget -= rejected_bytes(rejected)
                self._bytes -= rejected_bytes(rejected)
                batch.rejected.append(rejected)
            for request_id in list(self._pending):
                if len(batch.outputs) == self.max_outputs:
                    break
                size = self._sizes[request_id]
                if size <= budget:
                    batch.outputs.append(self._pending.pop(request_id))
                    del self._sizes[request_id]
                    self._merged.discard(request_id)
                    self._bytes -= size
                    budget -= size
                    continue
                head = self._split(request_id, budget)
                if head is not None:
                    batch.outputs.append(head)
                break
            batch.done = self._finished and not self._pending and not self._rejected
            batch.resume = before > self.resume_bytes >= self._bytes
            return batch

    def _split(self, request_id: str, budget: int) -> EngineOutput | None:
        """Cut the longest head that fits ``budget`` off a pending output; the rest
        (with the finish, if any) stays pending. None if not even one item fits."""
        out = self._pending[request_id]
        room = budget - _head_bytes(request_id)
        num_prompt = 0
        while num_prompt < len(out.prompt_logprobs) and logprob_bytes(out.prompt_logprobs[num_prompt]) <= room:
            room -= logprob_bytes(out.prompt_logprobs[num_prompt])
            num_prompt += 1
        num_tokens = 0
        if num_prompt == len(out.prompt_logprobs):  # tokens only after every prompt logprob
            while num_tokens < len(out.new_token_ids):
                cost = _TOKEN + (logprob_bytes(out.logprobs[num_tokens]) if out.logprobs else 0)
                if cost > room:
                    break
                room -= cost
                num_tokens += 1
        if num_prompt == 0 and num_tokens == 0:
            return None
        head, tail = out.split_at(num_prompt, num_tokens)
        self._pending[request_id] = tail
        self._merged.add(request_id)
        old_size = self._sizes[request_id]
        self._sizes[request_id] = output_bytes(tail)
        self._bytes -= old_size - self._sizes[request_id]
        return head
