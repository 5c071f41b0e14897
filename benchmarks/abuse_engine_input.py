"""Abuse scenarios aimed at what the engine reads: adapter directories and GGUF files,
registered in benchmarks.abuse (same command line).

    adapter-regex   rank_pattern keys "(.|.)*Z" and "(.|.)*(?=Z)" loaded beside a base-model stream:
                    each load's status and seconds, the stream's status and worst gap
    adapter-nan     an adapter with a NaN weight: the load's status, then a request under it
    lora-fresh      a name asked for (NOT_FOUND), loaded, asked again at once: seconds until served
    gguf-block-count, gguf-head-count, gguf-vocab-size, gguf-tensor-shape, gguf-context-length
                    an engine started on a GGUF that lies (block_count 10^6, head_count 0,
                    vocab_size 10^8, a wrong attn_q shape, context_length 2^32): seconds to
                    its exit, peak RSS, the line it ended with (given up after 90 s)

Each starts the processes it needs (an engine with --enable-lora and a frontend, or an
engine alone), the GGUF files written by tests/gguf_factory.py and the adapters by
tests/lora_factory.py; the pair benchmarks.abuse starts is not used. Run from an older
checkout with this file and those two copied in to measure the code before a change.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path

import grpc

from benchmarks.abuse_kit import outcome, req, rss_mib
from tandem_common.ready import read_ready_file
from tandem_protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc
from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tandem_protos.tandem.generate.v1 import generate_pb2_grpc
from tests.gguf_factory import write_tiny_gguf
from tests.services import start_engine, start_frontend

GIVE_UP_S = 90.0


class _LoraPair:
    def __init__(self, model: Path) -> None:
        self.engine = start_engine(model, "--enable-lora", "--num-kv-blocks", "512", "--max-cpu-loras", "8")
        self.engine.wait_serving()
        self.frontend = start_frontend(self.engine.address).wait_serving()

    def stop(self) -> None:
        self.frontend.terminate()
        self.engine.terminate(timeout=10)


def _adapter(root: Path, config: dict | None = None, spoil: str | None = None) -> Path:
    """A PEFT adapter of the demo model, its config updated by ``config``, tensor ``spoil`` set to NaN."""
    from engine_svc.demo_model import ensure_demo_model
    from tests.lora_factory import make_adapter

    base = root / "base-adapter"
    if not base.exists():
        make_adapter(ensure_demo_model(), base, r=4, alpha=8, seed=1)
    out = root / f"adapter-{len(list(root.iterdir()))}"
    shutil.copytree(base, out)
    if config:
        path = out / "adapter_config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | config))
    if spoil:
        from safetensors.torch import load_file, save_file

        tensors = load_file(out / "adapter_model.safetensors")
        tensors[spoil][0, 0] = float("nan")
        save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


def _under(model: str, max_tokens: int) -> g.GenerateRequest:
    """A greedy request under adapter ``model``."""
    request = req("under the adapter", max_tokens=max_tokens)
    request.model = model
    request.return_token_ids = True
    return request


async def _load(engine: str, name: str, path: Path, timeout: float = 30) -> str:
    t0 = time.monotonic()
    async with grpc.aio.insecure_channel(engine) as channel:
        try:
            await engine_pb2_grpc.EngineServiceStub(channel).LoadLoraAdapter(
                engine_pb2.LoadLoraAdapterRequest(name=name, path=str(path)), timeout=timeout
            )
            code = "OK"
        except grpc.aio.AioRpcError as e:
            code = e.code().name
    return f"{code} in {time.monotonic() - t0:.2f} s"


async def _with_lora_pair(body):
    from engine_svc.demo_model import ensure_demo_model

    pair = await asyncio.to_thread(_LoraPair, ensure_demo_model())
    try:
        with tempfile.TemporaryDirectory(prefix="abuse-lora-") as root:
            async with grpc.aio.insecure_channel(pair.frontend.address) as channel:
                return await body(pair, generate_pb2_grpc.GenerateServiceStub(channel), Path(root))
    finally:
        await asyncio.to_thread(pair.stop)


async def adapter_regex(_pair, _stub) -> str:
    async def body(pair, stub, root):
        adapters = [_adapter(root, {"rank_pattern": {key: 4}}) for key in ("(.|.)*Z", "(.|.)*(?=Z)")]
        times: list[float] = []

        async def victim():
            call = stub.Generate(req("victim", max_tokens=300), timeout=60)
            try:
                while await call.read() is not grpc.aio.EOF:
                    times.append(time.monotonic())
                return "OK"
            except grpc.aio.AioRpcError as e:
                return e.code().name

        task = asyncio.ensure_future(victim())
        await asyncio.sleep(1.5)
        t0 = time.monotonic()
        loads = [await _load(pair.engine.address, f"h{i}", path, timeout=20) for i, path in enumerate(adapters)]
        status = await task
        gaps = [b - a for a, b in zip([t0] + [t for t in times if t >= t0], [t for t in times if t >= t0])]
        return (
            f"load '(.|.)*Z': {loads[0]}; load '(.|.)*(?=Z)': {loads[1]}; base-model victim {status}, "
            f"{len(times)} messages, worst gap {max(gaps, default=time.monotonic() - t0) * 1e3:.0f} ms"
        )

    return await _with_lora_pair(body)


async def adapter_nan(_pair, _stub) -> str:
    async def body(pair, stub, root):
        path = _adapter(root, spoil="base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
        load = await _load(pair.engine.address, "nan", path)
        call = stub.Generate(_under("nan", 8), timeout=30)
        tokens, code = [], "OK"
        try:
            async for response in call:
                tokens.extend(response.token_ids)
        except grpc.aio.AioRpcError as e:
            code = e.code().name
        return f"load {load}; a request under it: {code}, {len(tokens)} tokens {tokens[:8]}"

    return await _with_lora_pair(body)


async def lora_fresh(_pair, _stub) -> str:
    async def body(pair, stub, root):
        path = _adapter(root)
        before, _ = await outcome(stub.Generate(_under("fresh", 2), timeout=30))
        await _load(pair.engine.address, "fresh", path)
        t0, refusals = time.monotonic(), 0
        while time.monotonic() - t0 < 10:
            code, _ = await outcome(stub.Generate(_under("fresh", 2), timeout=30))
            if code == "OK":
                break
            refusals += 1
            await asyncio.sleep(0.02)
        return (
            f"before the load {before}; after it: {refusals} NOT_FOUND answers, served "
            f"{time.monotonic() - t0:.2f} s after the load returned"
        )

    return await _with_lora_pair(body)


def _gguf_scenario(**lie):
    async def scenario(_pair, _stub) -> str:
        with tempfile.TemporaryDirectory(prefix="abuse-gguf-") as root:
            path = write_tiny_gguf(Path(root) / "lying.gguf", **lie)
            env = {"TANDEM_CACHE_DIR": str(Path(root) / "cache")}
            return await asyncio.to_thread(_start_and_watch, path, env)

    return scenario


def _start_and_watch(path: Path, env: dict) -> str:
    engine = start_engine(path, env=env)
    t0, peak = time.monotonic(), 0.0
    try:
        while engine.proc.poll() is None and time.monotonic() - t0 < GIVE_UP_S:
            try:
                peak = max(peak, _hwm_mib(engine.proc.pid))
            except (FileNotFoundError, ProcessLookupError):
                break
            if (read_ready_file(engine.ready_file) or {}).get("state") == "serving":
                break
            time.sleep(0.05)
        seconds = time.monotonic() - t0
        state = (
            f"exited {engine.proc.returncode}"
            if engine.proc.poll() is not None
            else f"still running after {seconds:.0f} s (RSS {rss_mib(engine.proc.pid):.0f} MiB)"
        )
        log = engine.log()
    finally:
        engine.terminate(timeout=10)
    lines = [line for line in log.splitlines() if line.strip()]
    last = lines[-1].strip() if lines else ""
    last = last if len(last) <= 160 else last[:157] + "..."
    tracebacks = log.count("Traceback")
    return f"{state} in {seconds:.1f} s, peak RSS {peak:.0f} MiB, {tracebacks} tracebacks; last line: {last}"


def _hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


SCENARIOS = {
    "adapter-regex": adapter_regex,
    "adapter-nan": adapter_nan,
    "lora-fresh": lora_fresh,
    "gguf-block-count": _gguf_scenario(metadata={"llama.block_count": 10**6}),
    "gguf-head-count": _gguf_scenario(metadata={"llama.attention.head_count": 0}),
    "gguf-vocab-size": _gguf_scenario(metadata={"llama.vocab_size": 10**8}),
    "gguf-tensor-shape": _gguf_scenario(shapes={"blk.1.attn_q.weight": (48, 64)}),
    "gguf-context-length": _gguf_scenario(metadata={"llama.context_length": 2**32}),
}
