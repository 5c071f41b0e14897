"""The Responses API's stored responses: a bounded, in-memory map from response id to answer.

    ResponseStore(max_bytes, max_age_s)
      .put(id, response, conversation)   kept unless it alone exceeds max_bytes; the oldest go first
      .get(id) ──▶ StoredResponse | None   None: never stored, deleted, evicted or older than max_age_s
      .delete(id) ──▶ bool

A stored response holds the Response object as answered (``GET /v1/responses/{id}``) and
its whole conversation as chat turns, its own output included: the turns a later request
with ``previous_response_id`` continues from. The conversation is copied whole into each
response of a chain, so that evicting an older response never breaks a newer one.

Both limits are flags (``--responses-store-max-bytes``, ``--responses-store-max-age-s``;
docs/limits.md). A response's size is the length of its JSON and its conversation's; past
``max_bytes`` in all the oldest are evicted first, so the store never holds more than
``max_bytes`` of them. Age is counted from when a response was stored. ``max_bytes`` 0
stores nothing. The store lives in one frontend process: with ``--workers`` each process
has its own, and a client that continues a response on another process's connection gets
``previous_response_not_found``.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object, as answered
    conversation: tuple[dict[str, Any], ...]  # chat turns through this response's output, without instructions
    size: int = 0
    stored_at: float = 0.0


class ResponseStore:
    def __init__(
        self,
        max_bytes: int,
        max_age_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Stores a finished response; False when it alone is larger than the store."""
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        if size > self.max_bytes:
            return False
        self.delete(response_id)
        self._entries[response_id] = StoredResponse(response, tuple(conversation), size=size, stored_at=self._clock())
        self.num_bytes += size
        self._expire()
        while self.num_bytes > self.max_bytes:
            self._pop_oldest()
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.num_bytes -= entry.size
        return True

    def describe(self) -> str:
        return f"at most {self.max_bytes} bytes of responses, each kept at most {self.max_age_s:g} s"

    def _expire(self) -> None:
        """Drops the responses older than max_age_s (the oldest are first)."""
        horizon = self._clock() - self.max_age_s
        while self._entries and next(iter(self._entries.values())).stored_at <= horizon:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self.num_bytes -= entry.size
