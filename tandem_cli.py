"""``tandem``: run the engine and the frontend together, and small helpers.

tandem serve [--model DIR]     start both services as two processes; Ctrl-C stops both
tandem try "Once upon a time"  start both on free ports, stream one completion, stop both
tandem demo-model DIR          write the built-in demo model to DIR
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time

_LISTENING = re.compile(r"listening on (\S+):(\d+)")


class Service:
    """A child service process whose log lines are echoed and watched for its port."""

    def __init__(self, name: str, argv: list[str], echo: bool) -> None:
        self.name = name
        self.port: int | None = None
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            start_new_session=True,  # Ctrl-C reaches us only; we stop the children in order
        )
        self._echo = echo
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stderr:
            if self._echo:
                sys.stderr.write(f"[{self.name}] {line}")
            m = _LISTENING.search(line)
            if m and self.port is None:
                self.port = int(m.group(2))

    def wait_port(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.port is None:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with code {self.proc.returncode} before listening")
            if time.monotonic() > deadline:
                raise SystemExit(f"{self.name} did not start listening within {timeout:.0f} s")
            time.sleep(0.05)
        return self.port

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _start_pair(args, engine_port: int, frontend_port: int, echo: bool) -> tuple[Service, Service]:
    engine_argv = [
        sys.executable,
        "-m",
        "engine_svc",
        "--host",
        args.host,
        "--port",
        str(engine_port),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
    ]
    if args.model:
        engine_argv += ["--model", args.model]
    engine = Service("engine", engine_argv + list(args.engine_arg), echo)
    try:
        port = engine.wait_port(120)
        frontend = Service(
            "frontend",
            [
                sys.executable,
                "-m",
                "frontend_svc",
                "--host",
                args.host,
                "--port",
                str(frontend_port),
                "--engine",
                f"{args.host}:{port}",
                *args.frontend_arg,
            ],
            echo,
        )
        frontend.wait_port(120)
    except BaseException:
        engine.stop()
        raise
    return engine, frontend


def _wait_serving(address: str, timeout: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise SystemExit(f"the frontend at {address} did not become SERVING within {timeout:.0f} s")


def _stream_completion(address: str, prompt: str, max_tokens: int) -> None:
    import grpc

    from tandem_protos.tandem.generate.v1 import generate_pb2, generate_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        request = generate_pb2.GenerateRequest(
            text=prompt, sampling_params=generate_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=0)
        )
        sys.stdout.write(prompt)
        for response in stub.Generate(request, timeout=300):
            sys.stdout.write(response.text)
            sys.stdout.flush()
            if response.finish_reason:
                usage = response.usage
                reason = generate_pb2.FinishReason.Name(response.finish_reason)
                sys.stdout.write(
                    f"\n\n[{reason}; {usage.prompt_tokens} prompt + {usage.completion_tokens} generated tokens]\n"
                )


def cmd_serve(args) -> int:
    engine, frontend = _start_pair(args, args.engine_port, args.port, echo=True)
    address = f"{args.host}:{frontend.port}"
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        _wait_serving(address, 300)
        print(f"Tandem is serving on {address} (engine on {args.host}:{engine.port}); Ctrl-C stops both.", flush=True)
        print(
            f'Try: grpcurl -plaintext -d \'{{"text": "Hello"}}\' {address} tandem.generate.v1.GenerateService/Generate',
            flush=True,
        )
        while not stop.is_set() and engine.proc.poll() is None and frontend.proc.poll() is None:
            stop.wait(0.5)
    finally:
        frontend.stop()
        engine.stop()
    return 0


def cmd_try(args) -> int:
    engine, frontend = _start_pair(args, 0, 0, echo=args.verbose)
    try:
        address = f"{args.host}:{frontend.port}"
        _wait_serving(address, 300)
        _stream_completion(address, args.prompt, args.max_tokens)
    finally:
        frontend.stop()
        engine.stop()
    return 0


def cmd_demo_model(args) -> int:
    from engine_svc.demo_model import build_demo_model

    path = build_demo_model(args.dir, force=args.force)
    print(f"demo model written to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem", description="Tandem: LLM serving as a pair of gRPC services.")
    sub = p.add_subparsers(dest="command", required=True)

    def pair_options(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--model",
            default=None,
            metavar="DIR",
            help="local Hugging Face model directory (default: the built-in demo model)",
        )
        sp.add_argument("--host", default="127.0.0.1", help="address both services listen on")
        sp.add_argument("--device", default=os.environ.get("TANDEM_DEVICE", "cpu"), help="cpu or cuda")
        sp.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
        sp.add_argument(
            "--engine-arg",
            action="append",
            default=[],
            metavar="ARG",
            help="extra tandem-engine argument (repeatable), e.g. --engine-arg=--max-num-seqs=64",
        )
        sp.add_argument(
            "--frontend-arg",
            action="append",
            default=[],
            metavar="ARG",
            help="extra tandem-frontend argument (repeatable)",
        )

    serve = sub.add_parser("serve", help="start the engine and the frontend; Ctrl-C stops both")
    pair_options(serve)
    serve.add_argument("--port", type=int, default=50050, help="frontend port (the public API)")
    serve.add_argument("--engine-port", type=int, default=50051, help="engine port")
    serve.set_defaults(func=cmd_serve)

    trial = sub.add_parser("try", help="start both on free ports, stream one completion, stop both")
    pair_options(trial)
    trial.add_argument("prompt", nargs="?", default="Once upon a time", help="text to complete")
    trial.add_argument("--max-tokens", type=int, default=48)
    trial.add_argument("--verbose", action="store_true", help="show the services' logs")
    trial.set_defaults(func=cmd_try)

    demo = sub.add_parser("demo-model", help="write the built-in demo model (random weights) to DIR")
    demo.add_argument("dir", help="output directory")
    demo.add_argument("--force", action="store_true", help="rebuild even if DIR already holds it")
    demo.set_defaults(func=cmd_demo_model)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
