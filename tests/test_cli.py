"""``tandem serve`` / ``tandem try`` supervise their two children (issue 18, items 13 and 16).

The real CLI runs as a subprocess with the real services under it. Every test is bounded
in time and kills whatever it started, children included, whatever happens.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import tandem_cli

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the CLI's children in /proc")


class Cli:
    """``python -m tandem_cli ARGS`` with its output gathered and its children tracked."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandem_cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.children: dict[int, str] = {}  # pid -> command line, every child ever seen
        for stream, lines in ((self.proc.stdout, self.stdout), (self.proc.stderr, self.stderr)):
            threading.Thread(target=lambda s=stream, out=lines: out.extend(s), daemon=True).start()

    def watch_children(self) -> dict[int, str]:
        for pid, cmdline in _children_of(self.proc.pid).items():
            # The newest non-empty command line: a child seen between fork and exec still
            # shows this CLI's, and a zombie's is empty.
            if cmdline or pid not in self.children:
                self.children[pid] = cmdline
        return self.children

    def wait_for(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            self.watch_children()
            assert time.monotonic() < deadline, f"{what} within {timeout} s; stderr:\n{''.join(self.stderr)}"
            assert self.proc.poll() is None or condition(), f"the CLI exited early:\n{''.join(self.stderr)}"
            time.sleep(0.05)

    def wait_exit(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            self.watch_children()
            assert time.monotonic() < deadline, f"the CLI still runs after {timeout} s:\n{''.join(self.stderr)}"
            time.sleep(0.05)
        time.sleep(0.2)  # the reader threads catch up
        return self.proc.returncode

    def live_children(self, timeout: float = 10.0) -> list[str]:
        """Children still alive ``timeout`` s after the CLI ended (an orphan is a failure)."""
        deadline = time.monotonic() + timeout
        while True:
            alive = [cmd for pid, cmd in self.children.items() if _alive(pid)]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.1)

    def cleanup(self) -> None:
        for pid in [*self.children, self.proc.pid]:
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.proc.wait(10)


def _children_of(pid: int) -> dict[int, str]:
    children = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                children[int(entry.name)] = (entry / "cmdline").read_text().replace("\0", " ")
        except (OSError, ValueError, IndexError):
            continue
    return children


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is due


def _has_both(cli: Cli) -> bool:
    commands = " ".join(cli.watch_children().values())
    return "engine_svc" in commands and "frontend_svc" in commands


def _broken_model(demo_model_dir: Path, tmp_path: Path) -> Path:
    """The demo model without its last layer's weights: the engine listens, reads the
    weights, and only then fails (as a real model with a bad checkpoint would)."""
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken-model"
    broken.mkdir()
    for f in demo_model_dir.iterdir():
        if f.suffix == ".safetensors":
            weights = load_file(f)
            save_file({k: v for k, v in weights.items() if ".layers.3." not in k}, broken / f.name)
        else:
            (broken / f.name).write_bytes(f.read_bytes())
    return broken


def test_a_model_that_fails_to_load_ends_serve_at_once_with_the_reason(demo_model_dir, tmp_path):
    model = _broken_model(demo_model_dir, tmp_path)
    cli = Cli("serve", "--model", str(model), "--port", "0", "--engine-port", "0", "--http-port", "0")
    try:
        assert cli.wait_exit(90) == 1  # it used to wait 300 s for a frontend that never serves
        err = "".join(cli.stderr)
        assert "the engine exited with code 1" in err and "failed to load the model" in err, err
        assert cli.live_children() == []
    finally:
        cli.cleanup()


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGKILL, -signal.SIGKILL)])
def test_a_signal_to_try_stops_both_services(demo_model_dir, sig, code):
    # Also the pass-through form that argparse alone refuses (item 16).
    cli = Cli(
        "try",
        "--model",
        str(demo_model_dir),
        "--engine-arg",
        "--max-num-seqs=4",
        "--engine-arg",
        "--max-num-batched-tokens 64",
    )
    try:
        cli.wait_for(lambda: _has_both(cli), 90, "both services never started")
        engine_cmd = next(c for c in cli.children.values() if "engine_svc" in c)
        assert "--max-num-seqs=4" in engine_cmd and "--max-num-batched-tokens 64" in engine_cmd
        cli.proc.send_signal(sig)
        assert cli.wait_exit(60) == code
        # SIGKILL leaves no time to clean up: the kernel stops the children (PDEATHSIG).
        assert cli.live_children(timeout=30) == []
    finally:
        cli.cleanup()


def test_serve_notices_a_dead_engine_at_once(demo_model_dir):
    cli = Cli("serve", "--model", str(demo_model_dir), "--port", "0", "--engine-port", "0", "--http-port", "0")
    try:
        cli.wait_for(lambda: any("Tandem is serving" in line for line in cli.stdout), 120, "never served")
        cli.wait_for(lambda: any("HTTP API on http://" in line for line in cli.stdout), 10, "no HTTP address")
        engine = next(pid for pid, c in cli.watch_children().items() if "engine_svc" in c)
        os.kill(engine, signal.SIGKILL)
        assert cli.wait_exit(30) == 1
        assert "the engine was killed by signal 9" in "".join(cli.stderr)
        assert cli.live_children() == []
    finally:
        cli.cleanup()


def test_pass_through_arguments_take_every_form():
    argv = ["try", "--engine-arg", "--max-num-seqs=4", "--engine-arg=--block-size=32", "--frontend-arg", "--max-n 2"]
    args = tandem_cli.build_parser().parse_args(tandem_cli._join_pass_through(argv))
    assert tandem_cli._split(args.engine_arg) == ["--max-num-seqs=4", "--block-size=32"]
    assert tandem_cli._split(args.frontend_arg) == ["--max-n", "2"]
    assert args.prompt == "Once upon a time"  # the value after --engine-arg is not the prompt


@pytest.mark.parametrize("mode, head", [((), "user: Hi\nassistant: "), (("--raw",), "Hi")])
def test_try_sends_a_chat_turn_where_the_model_has_a_template_and_raw_text_on_request(demo_model_dir, mode, head):
    cli = Cli("try", "--model", str(demo_model_dir), "--max-tokens", "4", *mode, "Hi")
    try:
        assert cli.wait_exit(180) == 0, "".join(cli.stderr)
        out = "".join(cli.stdout)
        assert out.startswith(head) and "4 generated tokens]" in out, out
    finally:
        cli.cleanup()
