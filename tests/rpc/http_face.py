"""Helpers for the HTTP face's tests: a frontend with --http-port 0 over the module's engine."""

from __future__ import annotations

import time

import grpc
import httpx

from tandem_common.ready import read_ready_file
from tandem_protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc
from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tandem_protos.tandem.generate.v1 import generate_pb2_grpc
from tests.services import ServiceProcess

API_KEY = "test-http-key"


def http_base(frontend: ServiceProcess) -> str:
    frontend.wait_serving()
    info = read_ready_file(frontend.ready_file)
    assert info is not None and "http_port" in info, info
    return f"http://127.0.0.1:{info['http_port']}"


def grpc_stream(address: str, request: g.GenerateRequest, key: str | None = API_KEY) -> list[g.GenerateResponse]:
    metadata = (("authorization", f"Bearer {key}"),) if key else None
    with grpc.insecure_channel(address) as channel:
        return list(generate_pb2_grpc.GenerateServiceStub(channel).Generate(request, timeout=60, metadata=metadata))


def engine_idle(engine_address: str, timeout: float = 10.0) -> bool:
    """Whether the engine runs and queues nothing within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(engine_address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        while time.monotonic() < deadline:
            load = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5).load
            if load.num_running == 0 and load.num_waiting == 0:
                return True
            time.sleep(0.05)
    return False


def engine_busy(engine_address: str) -> bool:
    with grpc.insecure_channel(engine_address) as channel:
        load = engine_pb2_grpc.EngineServiceStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=5).load
        return load.num_running + load.num_waiting > 0


def post(base: str, path: str, body, key: str | None = API_KEY, timeout: float = 60) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, (bytes, str)):
        return httpx.post(base + path, content=body, headers=headers, timeout=timeout)
    return httpx.post(base + path, json=body, headers=headers, timeout=timeout)
