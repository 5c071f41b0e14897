"""One engine's model info as this frontend knows it, kept as new as the engine's adapters.

The model info (GetModelInfo) is read once per session; it lists the engine's LoRA
adapters, which change while the engine runs. The engine's load reports carry
``lora_version``, which moves whenever an adapter is loaded or unloaded, and the view asks
again when it moves. Which version an answer reflects is known only by when it was asked:
a GetModelInfo sent after version v was seen lists v's adapters (or newer ones). So a
version counts as known only once a request sent after it was seen has succeeded::

    load: lora_version 7 ──▶ saw(7) ── GetModelInfo ── ok ──▶ known = 7
    load: lora_version 8 ──▶ saw(8) ── GetModelInfo ── fails ─▶ known stays 7: the next
                                                                load report asks again
                                                                (at most every RETRY_S)

A version that moves again while a request is in flight is asked for once more when it
returns, so the view never settles on adapters older than the last version reported.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from frontend_svc.types import ModelInfo

logger = logging.getLogger(__name__)

RETRY_S = 1.0  # after a failed GetModelInfo, the next load report asks again no sooner than this
DEFAULT_BLOCK_SIZE = 16  # the block size counted before any model info has come


class EngineModelView:
    """``info``: the engine's model as last read (None before its first session).
    ``fetch`` reads GetModelInfo (None when it failed)."""

    def __init__(self, address: str, fetch: Callable[[], Awaitable[ModelInfo | None]], on_change=None) -> None:
        self.address = address
        self.info: ModelInfo | None = None
        self._fetch = fetch
        self._on_change = on_change
        self._known_version: int | None = None  # the lora_version ``info`` is known to reflect
        self._seen_version: int | None = None  # the last lora_version the engine reported
        self._follow: asyncio.Task | None = None
        self._retry_at = 0.0

    def start_session(self, info: ModelInfo) -> None:
        """A new session read ``info``; the version it reflects is not known until a load reports one."""
        self.info = info
        self._known_version = self._seen_version = None

    @property
    def block_size(self) -> int:
        return self.info.block_size if self.info is not None else DEFAULT_BLOCK_SIZE

    def serves(self, lora_name: str | None) -> bool:
        """Whether the engine serves LoRA adapter ``lora_name`` (None: the base model)."""
        return lora_name is None or (self.info is not None and lora_name in self.info.lora_adapters)

    def lora_digest(self, lora_name: str | None) -> bytes | None:
        """The adapter's digest, the parent of its requests' first block hash (None: base)."""
        if lora_name is None or self.info is None:
            return None
        return self.info.lora_adapters.get(lora_name)

    def saw_lora_version(self, version: int) -> None:
        """The engine's load reported ``version``: read the model info again unless it is known."""
        self._seen_version = version
        if self.info is None or version == self._known_version or time.monotonic() < self._retry_at:
            return
        if self._follow is None or self._follow.done():
            self._follow = asyncio.create_task(self._catch_up(), name=f"model info {self.address}")

    async def refresh(self) -> bool:
        """Read the model info again now; False when the engine did not answer."""
        info = await self._fetch()
        if info is None:
            return False
        old = self.info.lora_adapters if self.info is not None else {}
        if info.lora_adapters != old:
            logger.info(
                "engine %s serves LoRA adapters: %s", self.address, ", ".join(sorted(info.lora_adapters)) or "none"
            )
        self.info = info
        if self._on_change is not None:
            self._on_change()
        return True

    async def _catch_up(self) -> None:
        while self._seen_version != self._known_version:
            wanted = self._seen_version
            if not await self.refresh():
                self._retry_at = time.monotonic() + RETRY_S
                return
            self._known_version = wanted

    def close(self) -> None:
        if self._follow is not None:
            self._follow.cancel()
