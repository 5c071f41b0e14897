"""Several prompts in one completions request: one call per prompt, their choices one answer.

    prompt: ["a", "b"], n: 2      call 0 ("a")  choices 0, 1  ──▶ answer indices 0, 1
                                  call 1 ("b")  choices 0, 1  ──▶ answer indices 2, 3

A choice's index is its prompt's index × n + its own, as OpenAI numbers them. Each prompt
is a call of its own (GenerateCall): admitted, planned, routed, counted and logged as
one prompt sent alone would be, so the call limit and the client's share hold per prompt.
Planning is all or nothing: a prompt that fails ends every call before anything runs.
Streamed, the calls run at once and their pieces go out as they come; a failure in one
ends the others.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace

from frontend_svc.service.generate_call import CallInput, GenerateCall
from frontend_svc.service.http.errors import bad_request
from frontend_svc.service.planning import GenerateInput, Plan
from frontend_svc.text.output_processor import ChoiceOutput

# Prompts in one request: each is a call and holds its prompt's tokens until it ends.
# The call limit (--max-concurrent-calls) bounds them too; this bounds the work a single
# body can ask before admission is tried.
MAX_PROMPTS = 256


def completion_prompts(prompt, gen: GenerateInput) -> list[GenerateInput]:
    """``gen`` with each of the request's prompts: a string, an array of token ids, or an
    array of either (at most MAX_PROMPTS)."""
    if isinstance(prompt, str) or _is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        prompts = prompt
    elif prompt is None:
        raise bad_request("prompt", "is required: a string or an array of token ids")
    else:
        raise bad_request("prompt", "must be a string, an array of token ids, or an array of those")
    if len(prompts) > MAX_PROMPTS:
        raise bad_request("prompt", f"at most {MAX_PROMPTS} prompts are allowed in one request, got {len(prompts)}")
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append(replace(gen, input="text", text=p))
        else:
            out.append(replace(gen, input="token_ids", token_ids=list(p)))
    return out


def _is_ids(p) -> bool:
    return isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)


@dataclass(frozen=True)
class Plans:
    """One plan per prompt, in the request's order; every plan has the same ``n``."""

    plans: list[Plan]

    @property
    def n(self) -> int:
        return self.plans[0].n


class PromptCalls:
    """The calls of a request's prompts, used as endpoint.py uses one GenerateCall."""

    def __init__(self, new_call: Callable[[], GenerateCall], num_prompts: int) -> None:
        self.calls = [new_call() for _ in range(num_prompts)]
        self.model = ""

    async def plan(self, requests: list[CallInput]) -> Plans:
        plans = []
        try:
            for call, request in zip(self.calls, requests, strict=True):
                plans.append(await call.plan(request))
        except BaseException:
            self.end()
            raise
        self.model = self.calls[0].model
        return Plans(plans)

    async def pieces(self, plans: Plans, on_done=None) -> AsyncGenerator[ChoiceOutput, None]:
        """Every prompt's pieces as they come, indexed prompt × n + choice."""
        streams = [call.pieces(plan, on_done) for call, plan in zip(self.calls, plans.plans, strict=True)]
        async with contextlib.aclosing(merged(streams, plans.n)) as pieces:
            async for piece in pieces:
                yield piece

    def end(self) -> None:
        for call in self.calls:
            call.end()


_DONE = object()


async def merged(streams: list[AsyncGenerator[ChoiceOutput, None]], n: int) -> AsyncGenerator[ChoiceOutput, None]:
    """The streams' pieces, stream k's choice i as index k × n + i. Each stream is read by
    a task of its own through a queue that holds one piece per stream, so a reader that
    stops reading stops them all (their engine requests are paused, as for one call). The
    first failure is raised; closing this generator cancels and closes every stream."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def pump(k: int, stream: AsyncGenerator[ChoiceOutput, None]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for piece in stream:
                    await queue.put(replace(piece, index=k * n + piece.index))
        except Exception as e:  # noqa: BLE001 -- raised by the reader
            await queue.put(e)
            return
        await queue.put(_DONE)

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            item = await queue.get()
            if item is _DONE:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
