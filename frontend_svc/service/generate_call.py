"""One Generate call from admission to its outcome: the lifecycle both public faces run.

    GenerateCall(generation, caller, request_id)       GenerateStats: in-flight gauge, server span
      .plan(CallInput) ──▶ Plan    1 calls.enter        the call limit, the client's share (flow.py)
                                   2 ready              an engine's model info, the tokenizer
                                   3 check_sizes        lengths only, before anything is copied
                                   4 the model name     the served model, a LoRA adapter, or NOT_FOUND
                                   5 convert, plan      the chat template rendered, the prompt tokenized
      .pieces(plan) ──▶ ChoiceOutput ...                Generation.stream: routing, engines, text
      .end()                                            calls.leave; the Outcome's metrics, span, log line

The same steps in the same order for gRPC (servicer.py) and HTTP (http/endpoint.py):
each face makes a CallInput of its request and its wire format of the pieces, and says
the outcome in its own words. The call ends itself when ``plan`` raises and when
``pieces`` ends, however it ends; ``end`` is there for a face whose pieces never ran
(an HTTP client gone before its stream began), and does nothing the second time.

The outcome: OK once the last piece was taken; a CallError's code with its message;
UNAVAILABLE when no engine could serve; RESOURCE_EXHAUSTED for a client that stopped
reading (the stalled-client sweeper cancelled it, flow.py); otherwise the client ended
the call: DEADLINE_EXCEEDED past its deadline, else CANCELLED (the outcome until then).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace

from frontend_svc.service.caller import Caller, Outcome
from frontend_svc.service.flow import Call
from frontend_svc.service.generation import Generation
from frontend_svc.service.planning import GenerateInput, Plan, RequestSizes, check_sizes
from frontend_svc.service.request_stats import GenerateStats
from frontend_svc.text.output_processor import ChoiceOutput
from frontend_svc.types import CallError, EngineUnavailableError


@dataclass(frozen=True)
class CallInput:
    """A face's Generate request as the lifecycle reads it."""

    model: str | None  # the model the client names; None or "": the served model
    sizes: RequestSizes  # its lengths, read without copying: checked before it is converted
    size: int  # its bytes or characters: past OFF_LOOP_BYTES it is converted and planned on a worker thread
    # Its plain values, or the conversion that makes them (run once the sizes are checked).
    input: GenerateInput | Callable[[], GenerateInput]


class GenerateCall:
    def __init__(self, generation: Generation, caller: Caller, request_id: str, attributes: dict | None = None) -> None:
        """``attributes``: the face's own on the call's span (an HTTP request's method and route)."""
        self.generation = generation
        self.caller = caller
        self.stats = GenerateStats(generation.metrics, generation.tracer, caller, request_id)
        if attributes and self.stats.span is not None:
            self.stats.span.set_attributes(attributes)
        self.outcome, self.message = Outcome.CANCELLED, ""
        self.model = ""  # the model the answer names (the adapter's or the served model's), once planned
        self._admitted: Call | None = None
        self._ended = False

    @property
    def stalled(self) -> bool:
        """Whether the stalled-client sweeper cancelled the call (its client reads nothing)."""
        return self._admitted is not None and self._admitted.stalled

    async def plan(self, request: CallInput) -> Plan:
        """The call admitted and its request planned; whatever it raises ends the call."""
        g = self.generation
        try:
            self._admitted = g.calls.enter(self.caller)
            tokenizer, info = g.ready()
            check_sizes(request.sizes, g.limits, info)
            lora_name = await g.lora_name(request.model)
            gen = request.input
            if not isinstance(gen, GenerateInput):
                gen = await g.off_loop(request.size, gen)
            plan = await g.plan(replace(gen, lora_name=lora_name), tokenizer, info, request.size)
        except BaseException as e:
            self._end(e)
            raise
        self.model = lora_name or info.model_name
        operation = "chat" if gen.input == "messages" else "text_completion"
        self.stats.planned(plan.prompt_token_ids, plan.n, plan.params, plan.text.stop, operation)
        return plan

    async def pieces(
        self, plan: Plan, on_done: Callable[[Callable[..., None]], None] | None = None
    ) -> AsyncGenerator[ChoiceOutput, None]:
        """The plan's pieces (Generation.stream, ``on_done`` as there); the call ends with
        them, however they end: taken to the last, an error, or closed by its reader."""
        try:
            async with contextlib.aclosing(self.generation.stream(plan, self.stats, on_done)) as pieces:
                async for piece in pieces:
                    yield piece
        except BaseException as e:  # GeneratorExit too: the reader went away
            self._end(e)
            raise
        self._end(None)

    async def write(self, context, response) -> None:
        """Writes ``response`` on a transport whose writes wait while the client reads nothing
        (gRPC's flow control), time-stamped for the stalled-client rule."""
        assert self._admitted is not None  # planned
        await self._admitted.write(context, response)

    def end(self) -> None:
        """Ends the call with its outcome: counted, traced, logged; once."""
        if self._ended:
            return
        self._ended = True
        if self._admitted is not None:
            self.generation.calls.leave(self._admitted)
        self.stats.end(self.outcome, self.message)  # metrics, span, the request's log line

    def _end(self, error: BaseException | None) -> None:
        if self._ended:
            return
        if error is None:
            self.outcome, self.message = Outcome.OK, ""
        elif isinstance(error, CallError):
            self.outcome, self.message = Outcome.of(error.code), str(error)
        elif isinstance(error, EngineUnavailableError):
            self.outcome, self.message = Outcome.UNAVAILABLE, str(error)
        elif self.stalled:
            self.outcome, self.message = Outcome.RESOURCE_EXHAUSTED, self.generation.calls.stalled_message()
        else:
            self.outcome = self.caller.gone()
        self.end()
