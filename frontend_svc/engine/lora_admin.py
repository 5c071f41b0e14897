"""LoRA adapters loaded and unloaded at run time on every engine of the served model.

    load_everywhere(router, name, path)   LoadLoraAdapter on every connected engine, at once:
                                          all or none (an engine that fails undoes the others)
    unload_everywhere(router, name)       UnloadLoraAdapter on every connected engine that has it

The engines' own RPCs (engine.proto) do the work and give the status: INVALID_ARGUMENT
(an adapter the engine cannot serve), ALREADY_EXISTS, NOT_FOUND, FAILED_PRECONDITION
(no --enable-lora; an adapter requests still use). Every connected engine serves the
same base model (the router accepts no other), so "every engine of the model" is every
connected one. All or none on load, so that routing never finds an adapter on some
engines only because a load half failed; an unload cannot be undone (the frontend does
not know the adapter's files), so it goes as far as it can and says where it stopped.
Once done, the engines' model info is asked again, so the adapter is listed and usable
by the time the answer leaves.
"""

from __future__ import annotations

import asyncio

from frontend_svc.engine import channel
from frontend_svc.engine.router import EngineRouter
from frontend_svc.types import CallError
from tandem_common.types import ErrorCode


async def load_everywhere(router: EngineRouter, name: str, path: str) -> list[str]:
    """The addresses of the engines that now serve adapter ``name`` from ``path``; CallError
    (the first engine's status) when any could not, the others' loads undone."""
    clients = _connected(router)
    results = await asyncio.gather(
        *(channel.load_lora(c.stub, c.address, name, path) for c in clients), return_exceptions=True
    )
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        loaded = [c for c, r in zip(clients, results, strict=True) if not isinstance(r, BaseException)]
        await asyncio.gather(*(channel.unload_lora(c.stub, c.address, name) for c in loaded), return_exceptions=True)
        first = failed[0]
        if not isinstance(first, CallError):
            raise first
        undone = f" (loaded, then unloaded again, on {', '.join(c.address for c in loaded)})" if loaded else ""
        raise CallError(first.code, f"{first}{undone}")
    await router.refresh_model_infos()
    return [c.address for c in clients]


async def unload_everywhere(router: EngineRouter, name: str) -> list[str]:
    """The addresses of the engines that stopped serving ``name``; NOT_FOUND when none had
    it; another engine's error (FAILED_PRECONDITION: requests still use it) as a CallError
    that names the engines already unloaded."""
    clients = _connected(router)
    results = await asyncio.gather(
        *(channel.unload_lora(c.stub, c.address, name) for c in clients), return_exceptions=True
    )
    done = [c.address for c, r in zip(clients, results, strict=True) if not isinstance(r, BaseException)]
    errors = [r for r in results if isinstance(r, BaseException)]
    await router.refresh_model_infos()
    other = next((e for e in errors if not (isinstance(e, CallError) and e.code is ErrorCode.NOT_FOUND)), None)
    if other is not None:
        if not isinstance(other, CallError):
            raise other
        where = f" (unloaded from {', '.join(done)})" if done else ""
        raise CallError(other.code, f"{other}{where}")
    if not done:
        raise CallError(ErrorCode.NOT_FOUND, f"no engine serves a LoRA adapter named {name!r}")
    return done


def _connected(router: EngineRouter) -> list:
    clients = [c for c in router.clients if c.connected]
    if not clients:
        raise CallError(ErrorCode.UNAVAILABLE, "no engine is connected; retry later")
    return clients
