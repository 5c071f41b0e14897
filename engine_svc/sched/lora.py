"""How many LoRA adapters one step may mix: ``--max-loras``.

Every running request is scheduled every step, so the bound holds for each step exactly
when it holds for the running set; it is kept at admission: a waiting request whose
adapter would be one too many is passed over (it keeps its place in the queue) until a
request of another adapter finishes. Requests of the base model and of adapters already
running are never held back by it. No torch here.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine_svc.sched.request import Request


class LoraStepLimit:
    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"--max-loras must be at least 1, got {max_loras}")
        self.max_loras = max_loras

    def admits(self, request: Request, running: Iterable[Request]) -> bool:
        """Whether ``request`` may join ``running`` without passing the bound."""
        if request.lora_name is None:
            return True
        names = {r.lora_name for r in running if r.lora_name is not None}
        return request.lora_name in names or len(names) < self.max_loras


class NoLoraLimit:
    """An engine without adapters: no request names one, none is held back."""

    def admits(self, request: Request, running: Iterable[Request]) -> bool:
        return True
