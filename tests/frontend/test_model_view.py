"""EngineModelView: the adapters a frontend knows are never older than the lora_version the
engine last reported, also when a GetModelInfo fails or the version moves during one."""

from __future__ import annotations

import asyncio

import pytest

from frontend_svc.engine import model_view
from frontend_svc.engine.model_view import EngineModelView
from frontend_svc.types import ModelInfo


class Engine:
    """What GetModelInfo answers: the adapters loaded now; ``fail`` makes the next answers fail."""

    def __init__(self) -> None:
        self.adapters: dict[str, bytes] = {}
        self.fail = 0
        self.calls = 0
        self.gate: asyncio.Event | None = None  # set: the answer waits for it

    async def fetch(self) -> ModelInfo | None:
        self.calls += 1
        snapshot = dict(self.adapters)  # what the engine held when the call arrived
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            self.fail -= 1
            return None
        return ModelInfo("m", 64, 2048, lora_adapters=snapshot)


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_a_failed_read_is_asked_again_at_the_next_load_report(monkeypatch):
    monkeypatch.setattr(model_view, "RETRY_S", 0.0)
    engine = Engine()
    view = EngineModelView("e", engine.fetch)
    view.start_session(ModelInfo("m", 64, 2048))
    view.saw_lora_version(0)
    await settle()
    engine.adapters["a"] = b"d"
    engine.fail = 1
    view.saw_lora_version(1)
    await settle()
    assert not view.serves("a")  # the read failed
    view.saw_lora_version(1)  # the same version again: it is not known yet, so it is asked for
    await settle()
    assert view.serves("a")
    calls = engine.calls
    view.saw_lora_version(1)
    await settle()
    assert engine.calls == calls  # known now: nothing more is asked


async def test_a_version_that_moves_during_a_read_is_read_again():
    engine = Engine()
    view = EngineModelView("e", engine.fetch)
    view.start_session(ModelInfo("m", 64, 2048))
    engine.gate = asyncio.Event()
    view.saw_lora_version(1)
    await settle()  # the read for version 1 is in flight, with no adapter yet
    engine.adapters["late"] = b"d"
    view.saw_lora_version(2)
    engine.gate.set()
    await settle()
    assert view.serves("late")
    assert engine.calls == 2


@pytest.mark.parametrize("known", [True, False])
def test_base_model_is_always_served(known):
    view = EngineModelView("e", Engine().fetch)
    if known:
        view.start_session(ModelInfo("m", 64, 2048))
    assert view.serves(None)
    assert view.lora_digest(None) is None
    assert view.block_size == 16
