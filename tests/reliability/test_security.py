"""Transport security: the engine warns when it is reachable beyond loopback without
mutual TLS, refuses to start plaintext when TLS was half asked for, and, with mutual TLS,
refuses every client (frontend included) that shows no certificate.

The engines started on 0.0.0.0 below load no model: the subprocess exits on its own right
after the start-up checks, the in-process servers are stopped at once. They hold a port
on every interface only for those moments.
"""

from __future__ import annotations

import asyncio
import shutil

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.reliability.faults import NOT_SERVING, SERVING, wait_health
from tests.rpc.frontend_calls import generate, stub_of
from tests.rpc.test_frontend_tls import make_pki, wait_serving_tls
from tests.services import ServiceProcess, start_engine, start_frontend

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
WARNING = "WARNING engine_svc.service.server: the engine listens on 0.0.0.0"
REMEDIES = (
    "Use mutual TLS (--tls-cert/--tls-key/--tls-ca) or restrict the port to frontends "
    "(the Helm chart's NetworkPolicy does this)."
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def _whole_log(proc: ServiceProcess, timeout: float = 60.0) -> str:
    """The log of a process that exits by itself (killed if it does not)."""
    try:
        proc.proc.wait(timeout)
    finally:
        proc.kill()
    proc.terminate()  # joins the log reader
    return proc.log()


def test_engine_on_a_public_address_without_tls_warns(shared, tmp_path):
    """``tandem-engine --host 0.0.0.0 --port 0`` as an operator would type it."""
    engine = start_engine(tmp_path / "no-model", "--host", "0.0.0.0")  # the last --host wins
    log = _whole_log(engine)
    assert "listening on 0.0.0.0:" in log and "failed to load the model" in log, log
    assert f"{WARNING} without TLS: anyone who can reach this port can generate text" in log
    assert REMEDIES in log
    # Loopback is private to the host: no warning.
    assert "listening on 127.0.0.1" in shared[0].log() and "WARNING engine_svc.service.server" not in shared[0].log()


@pytest.mark.parametrize(
    "tls, warning",
    [
        ("server-only", "with TLS but without client certificates (--tls-ca)"),
        ("mutual", None),
        ("ca-without-certificate", "SystemExit"),
    ],
    ids=["server-only", "mutual", "ca-without-certificate"],
)
async def test_engine_tls_variants_on_a_public_address(pki, caplog, tls, warning):
    """The same start-up checks in-process, for each TLS set-up (no model is loaded)."""
    from engine_svc.config import EngineConfig
    from engine_svc.service.server import EngineServer

    files = {
        "server-only": dict(tls_cert=pki / "server.pem", tls_key=pki / "server.key"),
        "mutual": dict(tls_cert=pki / "server.pem", tls_key=pki / "server.key", tls_ca=pki / "ca.pem"),
        "ca-without-certificate": dict(tls_ca=pki / "ca.pem"),
    }[tls]
    server = EngineServer(EngineConfig(host="0.0.0.0", port=0, **{k: str(v) for k, v in files.items()}))
    caplog.set_level("INFO", logger="engine_svc.service.server")
    try:
        if warning == "SystemExit":  # TLS half asked for is an error, never a plaintext fallback
            with pytest.raises(SystemExit, match="--tls-key and --tls-ca need --tls-cert"):
                await server.start()
            assert not server.port
            return
        await server.start()
        assert server.port and "listening on 0.0.0.0" in caplog.text and "(TLS)" in caplog.text
    finally:
        if server.server is not None:
            await server.server.stop(None)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    if warning is None:
        assert not warnings
    else:
        assert len(warnings) == 1 and warning in warnings[0] and REMEDIES in warnings[0]


async def test_mutual_tls_engine_refuses_clients_without_a_certificate(demo_model_dir, pki, procs):
    engine = procs(
        start_engine(
            demo_model_dir,
            "--num-kv-blocks",
            "64",
            "--tls-cert",
            str(pki / "server.pem"),
            "--tls-key",
            str(pki / "server.key"),
            "--tls-ca",
            str(pki / "ca.pem"),
        )
    )
    await asyncio.to_thread(wait_serving_tls, engine, pki, client_cert=True)

    ca_only = grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes())
    for channel in (grpc.secure_channel(engine.address, ca_only), grpc.insecure_channel(engine.address)):
        with channel, pytest.raises(grpc.RpcError) as error:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE

    # A frontend that trusts the engine but shows no certificate never gets a stream.
    no_cert = procs(start_frontend(engine.address, extra=("--engine-tls-ca", str(pki / "ca.pem")))).wait_listening()
    with_cert = procs(
        start_frontend(
            engine.address,
            extra=(
                "--engine-tls-ca",
                str(pki / "ca.pem"),
                "--engine-tls-cert",
                str(pki / "client.pem"),
                "--engine-tls-key",
                str(pki / "client.key"),
            ),
        )
    )
    await wait_health(with_cert, SERVING)
    await wait_health(no_cert, NOT_SERVING)
    async with grpc.aio.insecure_channel(no_cert.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await generate(stub_of(channel), text="hi", params=dict(max_tokens=2))
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    async with grpc.aio.insecure_channel(with_cert.address) as channel:
        responses = await generate(stub_of(channel), text="hi", params=dict(max_tokens=2, ignore_eos=True))
        assert responses[-1].usage.completion_tokens == 2
    assert f"engine {engine.address} connected" not in no_cert.log()
    assert f"engine {engine.address} connected" in with_cert.log()
    assert f"engine {engine.address} not reachable: UNAVAILABLE" in no_cert.log()
