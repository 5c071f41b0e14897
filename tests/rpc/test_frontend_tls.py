"""TLS end to end: client -TLS-> frontend -mutual TLS-> engine, with certificates made by openssl."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.rpc.frontend_calls import generate, stub_of
from tests.services import ServiceProcess, start_engine, start_frontend

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(d: Path) -> Path:
    """A CA plus 'server' and 'client' certificates valid for 127.0.0.1 and localhost."""
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl(
        "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=tandem-test-ca", "-days", "1", cwd=d
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "1",
            "-extfile",
            "san.ext",
            cwd=d,
        )
    return d


def _secure_channel(address: str, pki: Path, *, client_cert: bool) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        (pki / "ca.pem").read_bytes(),
        (pki / "client.key").read_bytes() if client_cert else None,
        (pki / "client.pem").read_bytes() if client_cert else None,
    )
    return grpc.secure_channel(address, creds)


def wait_serving_tls(proc: ServiceProcess, pki: Path, *, client_cert: bool, timeout: float = 120) -> None:
    proc.wait_listening(timeout)
    deadline = time.monotonic() + timeout
    with _secure_channel(proc.address, pki, client_cert=client_cert) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            if proc.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{proc.module} not SERVING over TLS:\n{proc.log()}")
            time.sleep(0.1)


async def test_tls_to_the_frontend_and_mutual_tls_to_the_engine(demo_model_dir, tmp_path):
    pki = make_pki(tmp_path)
    engine = start_engine(
        demo_model_dir,
        "--tls-cert",
        str(pki / "server.pem"),
        "--tls-key",
        str(pki / "server.key"),
        "--tls-ca",
        str(pki / "ca.pem"),
    )
    frontend = None
    try:
        wait_serving_tls(engine, pki, client_cert=True)
        frontend = start_frontend(
            engine.address,
            extra=(
                "--engine-tls-ca",
                str(pki / "ca.pem"),
                "--engine-tls-cert",
                str(pki / "client.pem"),
                "--engine-tls-key",
                str(pki / "client.key"),
                "--tls-cert",
                str(pki / "server.pem"),
                "--tls-key",
                str(pki / "server.key"),
            ),
        )
        await asyncio.to_thread(wait_serving_tls, frontend, pki, client_cert=False)
        creds = grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes())
        async with grpc.aio.secure_channel(frontend.address, creds) as channel:
            responses = await generate(stub_of(channel), text="hi", params=dict(max_tokens=3, ignore_eos=True))
        assert responses[-1].usage.completion_tokens == 3
        # Plaintext to a TLS port fails.
        async with grpc.aio.insecure_channel(frontend.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError):
                await generate(stub_of(channel), text="hi", timeout=5)
    finally:
        if frontend is not None:
            frontend.terminate()
        engine.terminate()
