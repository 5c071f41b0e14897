"""A minimal asyncio client of the engine's bidi stream, for tests and benchmarks."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field

import grpc

from tandem_protos.tandem.engine.v1 import engine_pb2 as pb
from tandem_protos.tandem.engine.v1 import engine_pb2_grpc


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: int = 0
    error: pb.Error | None = None
    num_cached_tokens: int = 0
    num_messages: int = 0
    num_finishes: int = 0  # the protocol allows exactly one
    first_output: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)


class EngineStream:
    """One Stream call; ``add`` / ``abort`` write control messages, results gather by id."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.stub = engine_pb2_grpc.EngineServiceStub(channel)
        self._outbox: asyncio.Queue = asyncio.Queue()
        self.results: dict[str, Result] = defaultdict(Result)
        self.foreign_ids: list[str] = []  # outputs for ids this stream never added
        self.loads: list[pb.EngineLoad] = []
        self.rejected: list[pb.RejectedAdd] = []  # refused duplicate adds
        self.got_rejection = asyncio.Event()
        self.message_sizes: list[int] = []  # serialized size of every StreamResponse
        self.kv_events: list[pb.KvEvent] = []  # prefix-cache events, in arrival order
        self.kv_hashes_per_message: list[int] = []  # for messages that carried any
        self.kv_changed = asyncio.Event()  # set whenever kv events arrive
        self.call = self.stub.Stream(self._requests())
        self._reader = asyncio.create_task(self._read())

    async def _requests(self):
        while True:
            msg = await self._outbox.get()
            if msg is None:
                return
            yield msg

    async def _read(self) -> None:
        async for response in self.call:
            self.message_sizes.append(response.ByteSize())
            self.loads.append(response.load)
            if response.rejected:
                self.rejected.extend(response.rejected)
                self.got_rejection.set()
            if response.kv_events:
                self.kv_events.extend(response.kv_events)
                self.kv_hashes_per_message.append(
                    sum(len(getattr(e, e.WhichOneof("event")).block_hashes) for e in response.kv_events)
                )
                self.kv_changed.set()
            for out in response.outputs:
                if out.request_id not in self.results:
                    self.foreign_ids.append(out.request_id)
                r = self.results[out.request_id]
                r.num_messages += 1
                r.token_ids.extend(out.new_token_ids)
                r.num_cached_tokens = max(r.num_cached_tokens, out.num_cached_tokens)
                r.first_output.set()
                if out.finish_reason:
                    r.num_finishes += 1
                    r.finish_reason = out.finish_reason
                    if out.HasField("error"):
                        r.error = out.error
                    r.done.set()

    def add(self, request_id: str, prompt: list[int], **params) -> Result:
        result = self.results[request_id]
        self._outbox.put_nowait(
            pb.StreamRequest(
                add=pb.Add(
                    request_id=request_id,
                    prompt_token_ids=prompt,
                    sampling_params=pb.SamplingParams(**params),
                )
            )
        )
        return result

    def abort(self, *request_ids: str, reason: int = pb.ABORT_REASON_UNSPECIFIED) -> None:
        self._outbox.put_nowait(pb.StreamRequest(abort=pb.Abort(request_ids=list(request_ids), reason=reason)))

    def pause(self, *request_ids: str) -> None:
        self._outbox.put_nowait(pb.StreamRequest(pause_requests=pb.PauseRequests(request_ids=list(request_ids))))

    def resume(self, *request_ids: str) -> None:
        self._outbox.put_nowait(pb.StreamRequest(resume_requests=pb.ResumeRequests(request_ids=list(request_ids))))

    def subscribe_kv_events(self) -> None:
        self._outbox.put_nowait(pb.StreamRequest(subscribe_kv_events=pb.SubscribeKvEvents()))

    def close(self) -> None:
        """Half-close: the engine finishes the stream's requests, then ends the call."""
        self._outbox.put_nowait(None)

    async def wait(self, *request_ids: str, timeout: float = 60.0) -> None:
        await asyncio.wait_for(asyncio.gather(*(self.results[r].done.wait() for r in request_ids)), timeout)

    async def finished(self, timeout: float = 60.0) -> None:
        await asyncio.wait_for(self._reader, timeout)

    async def status(self, timeout: float = 60.0) -> grpc.StatusCode:
        """How the call ended (OK, or the error code it failed with)."""
        try:
            await asyncio.wait_for(self._reader, timeout)
        except grpc.aio.AioRpcError as e:
            return e.code()
        return grpc.StatusCode.OK

    def cancel(self) -> None:
        self.call.cancel()
        self._reader.cancel()


async def wait_idle(stub: engine_pb2_grpc.EngineServiceStub, timeout: float = 20.0) -> pb.EngineLoad:
    """Poll GetLoad until no request runs or waits and no KV block is used."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        load = (await stub.GetLoad(pb.GetLoadRequest())).load
        if load.num_running == 0 and load.num_waiting == 0 and load.num_used_blocks == 0:
            return load
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"engine not idle after {timeout} s: {load}")
        await asyncio.sleep(0.05)
