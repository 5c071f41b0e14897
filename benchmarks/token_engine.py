"""A load-testing engine: serves tandem.engine.v1.EngineService with no model at all.

    python -m benchmarks.token_engine [--model DIR] [--port 0] [--step-ms 1] [--step-ms-file PATH]
        [--ready-file PATH]

It exists to drive a frontend at GPU-like token rates on a small machine, and only for
benchmarks: it is never a stand-in for the real engine in tests of engine behaviour.

Every ``--step-ms`` milliseconds it runs one "step": each live request of each stream
gets one token (when the process woke late, the steps it missed run at once, up to 8
tokens per request, so the offered rate holds), and each stream with news gets one
StreamResponse, as the real engine does; while a stream's previous message is still
being written, the next steps' tokens are merged per request into one message (as the
engine's StreamBacklog merges for a frontend that lags). ``--step-ms-file`` lets a
benchmark change the period while it runs. Requests follow the engine's finish rules:
max_tokens and the context length end them with LENGTH; a stop token id (or EOS unless
ignore_eos) after min_tokens ends them with STOP; Abort and a closed stream end them
with ABORT; an Add whose id is in flight is ignored (the engine refuses it in band). The
tokens are the ids of a sample text in the model's tokenizer, cycled, so the frontend
detokenizes real text. GetModelInfo and GetTokenizer serve the model directory's files
(default: the built-in demo model), so a frontend needs nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from tandem_common.ready import remove_ready_file, write_ready_file
from tandem_common.tokenizer_files import SERVED_TOKENIZER_FILE_NAMES
from tandem_protos.tandem.engine.v1 import engine_pb2 as pb
from tandem_protos.tandem.engine.v1 import engine_pb2_grpc

logger = logging.getLogger("benchmarks.token_engine")

SAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog while the river runs past the old mill, "
    "and a small boat drifts along under a grey and quiet sky. "
)
STEP_FILE_POLL_S = 0.2
MAX_CATCH_UP_STEPS = 8  # most steps a late wake-up runs at once


@dataclass
class _Request:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    min_tokens: int
    stop_token_ids: frozenset[int]
    num_out: int = 0


@dataclass(eq=False)  # hashed by identity: streams live in a set
class _Stream:
    """One stream's live requests and the outputs its writer has not sent yet, merged per
    request while a write is on its way (as the engine's StreamBacklog does)."""

    live: dict[str, _Request] = field(default_factory=dict)
    pending: dict[str, pb.RequestOutput] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    half_closed: bool = False
    ended: bool = False  # nothing more will be put; the writer ends the call once pending is sent

    def put(self, outputs: list[pb.RequestOutput]) -> None:
        for out in outputs:
            held = self.pending.get(out.request_id)
            if held is None:
                self.pending[out.request_id] = out
            else:  # ids, then the finish (an abort's output has no tokens)
                held.new_token_ids.extend(out.new_token_ids)
                if out.finish_reason:
                    held.finish_reason = out.finish_reason
                    if out.HasField("stop_token_id"):
                        held.stop_token_id = out.stop_token_id
        self.wake.set()

    def end(self) -> None:
        self.ended = True
        self.wake.set()


class TokenEngine(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self, model_dir: Path, step_s: float, max_model_len: int) -> None:
        from tokenizers import Tokenizer

        self.model_dir = model_dir
        self.step_s = step_s
        self.max_model_len = max_model_len
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.vocab_size = tokenizer.get_vocab_size()
        self.tokens = tokenizer.encode(SAMPLE_TEXT, add_special_tokens=False).ids
        self.streams: set[_Stream] = set()
        self.num_steps = 0
        self.num_late_steps = 0  # steps that ran missed steps too (several tokens per request)

    def _load(self) -> pb.EngineLoad:
        running = sum(len(s.live) for s in self.streams)
        return pb.EngineLoad(num_running=running)

    # -- the step loop ---------------------------------------------------------------------

    async def run(self, step_file: Path | None = None) -> None:
        next_step = time.perf_counter()
        checked = 0.0
        while True:
            if step_file is not None and next_step - checked > STEP_FILE_POLL_S:
                checked = next_step
                self._read_step(step_file)
            next_step += self.step_s
            delay = next_step - time.perf_counter()
            num_tokens = 1
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                # Behind (this process got no CPU in time): the steps missed are run now, as
                # one step of several tokens, so the token rate offered holds; past
                # MAX_CATCH_UP_STEPS the rest is dropped.
                missed = int(-delay / self.step_s)
                num_tokens = 1 + min(missed, MAX_CATCH_UP_STEPS - 1)
                next_step = time.perf_counter() if missed >= MAX_CATCH_UP_STEPS else next_step + missed * self.step_s
                await asyncio.sleep(0)
            self.step(num_tokens)

    def _read_step(self, path: Path) -> None:
        with contextlib.suppress(OSError, ValueError):
            step_s = float(path.read_text()) / 1000.0
            if step_s > 0 and step_s != self.step_s:
                self.step_s = step_s
                logger.info("one step every %.3f ms (%d steps ran late so far)", step_s * 1000, self.num_late_steps)

    def step(self, num_tokens: int = 1) -> None:
        self.num_steps += 1
        self.num_late_steps += num_tokens > 1
        for stream in list(self.streams):
            if not stream.live:
                continue
            outputs = [self._advance(r, num_tokens) for r in list(stream.live.values())]
            for out in outputs:
                if out.finish_reason:
                    del stream.live[out.request_id]
            stream.put(outputs)
            if stream.half_closed and not stream.live:
                stream.end()

    def _advance(self, r: _Request, num_tokens: int) -> pb.RequestOutput:
        out = pb.RequestOutput(request_id=r.request_id, num_prompt_tokens=r.num_prompt_tokens)
        for _ in range(num_tokens):
            token = self.tokens[r.num_out % len(self.tokens)]
            r.num_out += 1
            out.new_token_ids.append(token)
            if r.num_out >= r.min_tokens and token in r.stop_token_ids:
                out.finish_reason = pb.FINISH_REASON_STOP
                out.stop_token_id = token
                break
            if r.num_out >= r.max_tokens or r.num_prompt_tokens + r.num_out >= self.max_model_len:
                out.finish_reason = pb.FINISH_REASON_LENGTH
                break
        return out

    # -- RPCs --------------------------------------------------------------------------------

    async def Stream(self, request_iterator, context):
        stream = _Stream()
        self.streams.add(stream)
        reader = asyncio.create_task(self._read(stream, request_iterator))
        try:
            while True:
                await stream.wake.wait()
                stream.wake.clear()
                if stream.pending:
                    outputs, stream.pending = list(stream.pending.values()), {}
                    yield pb.StreamResponse(outputs=outputs, load=self._load())
                if stream.ended and not stream.pending:
                    return
        finally:
            reader.cancel()
            self.streams.discard(stream)

    async def _read(self, stream: _Stream, request_iterator) -> None:
        async for msg in request_iterator:
            if msg.HasField("add"):
                add = msg.add
                if add.request_id in stream.live:  # the engine refuses it in band; here it is only said
                    logger.warning("add for %s, already in flight, ignored", add.request_id)
                    continue
                p = add.sampling_params
                r = _Request(
                    add.request_id,
                    len(add.prompt_token_ids),
                    max_tokens=p.max_tokens if p.HasField("max_tokens") else 16,
                    min_tokens=p.min_tokens,
                    stop_token_ids=frozenset(p.stop_token_ids),
                )
                stream.live[add.request_id] = r
            elif msg.HasField("abort"):
                aborted = [stream.live.pop(rid) for rid in msg.abort.request_ids if rid in stream.live]
                if aborted:
                    stream.put(
                        [
                            pb.RequestOutput(
                                request_id=r.request_id,
                                finish_reason=pb.FINISH_REASON_ABORT,
                                num_prompt_tokens=r.num_prompt_tokens,
                            )
                            for r in aborted
                        ]
                    )
        stream.half_closed = True
        if not stream.live:
            stream.end()

    async def GetModelInfo(self, request, context):
        return pb.GetModelInfoResponse(
            model_name=f"token-engine:{self.model_dir.name}",
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            dtype="none",
            block_size=16,
            architecture="none",
            device="none",
        )

    async def GetLoad(self, request, context):
        return pb.GetLoadResponse(load=self._load())

    async def GetTokenizer(self, request, context):
        for name in SERVED_TOKENIZER_FILE_NAMES:
            path = self.model_dir / name
            if path.is_file():
                data = path.read_bytes()
                yield pb.GetTokenizerResponse(
                    file_name=name, offset=0, data=data, total_size=len(data), sha256=hashlib.sha256(data).hexdigest()
                )


async def serve(args) -> None:
    model_dir = Path(args.model) if args.model else None
    if model_dir is None:
        from engine_svc.demo_model import ensure_demo_model

        model_dir = ensure_demo_model()
    engine = TokenEngine(model_dir, args.step_ms / 1000.0, args.max_model_len)
    server = grpc.aio.server(
        options=[("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    )
    engine_pb2_grpc.add_EngineServiceServicer_to_server(engine, server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()
    write_ready_file(args.ready_file, service="token-engine", host=args.host, port=port, state="serving")
    logger.info("token engine on %s:%d, one step every %.2f ms", args.host, port, args.step_ms)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    stepper = asyncio.create_task(engine.run(Path(args.step_ms_file) if args.step_ms_file else None))
    await stop.wait()
    remove_ready_file(args.ready_file)
    stepper.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await stepper
    await server.stop(grace=1.0)
    logger.info(
        "stopped after %d steps, %d of them late (several tokens each)", engine.num_steps, engine.num_late_steps
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.token_engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory whose tokenizer files are served (default: demo)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--step-ms", type=float, default=1.0, help="milliseconds between steps (one token per request)")
    p.add_argument(
        "--step-ms-file",
        default=None,
        metavar="PATH",
        help="a file holding the step period in ms, read about every 0.2 s: a benchmark changes the token rate "
        "without a restart (benchmarks.capacity)",
    )
    p.add_argument("--max-model-len", type=int, default=1 << 20)
    p.add_argument("--ready-file", default=None, help="JSON with the port, as the real services write it")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.step_ms <= 0:
        p.error("--step-ms must be positive")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
