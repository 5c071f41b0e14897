"""What the container images rely on, checked without Docker.

* docker/frontend-requirements.txt is pyproject's dependency list minus torch, gguf,
  google-re2 and grpcio-tools (the frontend image installs the wheel with --no-deps, then that file).
* The Dockerfiles keep their promises: multi-stage, non-root, no HEALTHCHECK, torch only in
  the engine image.
* docker/tandem-health-probe, the exec probe the chart uses on TLS ports, against real
  in-process gRPC servers: plaintext, TLS, and mTLS with certificates made by openssl.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import re
import shutil
import socket
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from packaging.requirements import Requirement

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml on Python 3.10 needs tomli")

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
FRONTEND_ONLY_EXCLUDED = {"torch", "grpcio-tools", "gguf", "google-re2"}
SERVER_NAME = "engine.test.svc.cluster.local"


def _requirements(lines) -> dict[str, Requirement]:
    parsed = [Requirement(line) for line in lines]
    return {re.sub(r"[-_.]+", "-", r.name).lower(): r for r in parsed}


def _dockerfile(name: str) -> list[str]:
    """Instructions of a Dockerfile, continuation lines joined, comments dropped."""
    text = (DOCKER / name).read_text()
    text = re.sub(r"\\\n", " ", text)
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


# --------------------------------------------------------------------------- dependencies


def test_frontend_requirements_match_pyproject_without_torch():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    expected = _requirements(pyproject["project"]["dependencies"])
    for name in FRONTEND_ONLY_EXCLUDED:
        expected.pop(name, None)
    lines = [
        line.strip()
        for line in (DOCKER / "frontend-requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    actual = _requirements(lines)
    assert "torch" not in actual
    assert {n: str(r.specifier) for n, r in actual.items()} == {n: str(r.specifier) for n, r in expected.items()}, (
        "docker/frontend-requirements.txt must equal pyproject.toml's dependencies minus "
        f"{sorted(FRONTEND_ONLY_EXCLUDED)}"
    )


# --------------------------------------------------------------------------- Dockerfiles


@pytest.mark.parametrize("name", ["engine.Dockerfile", "frontend.Dockerfile"])
def test_dockerfile_shape(name):
    instructions = _dockerfile(name)
    upper = [line.split()[0].upper() for line in instructions]
    assert "HEALTHCHECK" not in upper
    assert upper.count("FROM") >= 3, "multi-stage: wheel, venv, final"
    assert "ARG BASE_IMAGE=python:3.11-slim" in instructions
    final = instructions[max(i for i, word in enumerate(upper) if word == "FROM") :]
    assert "USER 10001:10001" in final
    assert not [line for line in final if line.upper().startswith("RUN")], "nothing is built in the final stage"
    assert any("tandem-health-probe" in line for line in final)
    assert any(line.startswith("COPY --from=venv /opt/venv") for line in final)


def test_engine_dockerfile_takes_torch_from_a_configurable_index():
    instructions = _dockerfile("engine.Dockerfile")
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in instructions
    assert any('--index-url "${TORCH_INDEX_URL}"' in line for line in instructions)


def test_frontend_dockerfile_installs_without_torch():
    instructions = _dockerfile("frontend.Dockerfile")
    installs = [line for line in instructions if "pip install" in line]
    assert any("--no-deps /dist/*.whl" in line for line in installs)
    assert any("-r /tmp/frontend-requirements.txt" in line for line in installs)
    assert not [line for line in installs if re.search(r"pip install[^&]*\btorch\b", line)]


# --------------------------------------------------------------------------- health probe


def _load_probe():
    path = DOCKER / "tandem-health-probe"
    loader = importlib.machinery.SourceFileLoader("tandem_health_probe", str(path))
    spec = importlib.util.spec_from_loader("tandem_health_probe", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


probe = _load_probe()


def _serve(port_binder):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = port_binder(server)
    server.start()
    return server, servicer, port


@pytest.fixture
def plaintext_server():
    server, servicer, port = _serve(lambda s: s.add_insecure_port("127.0.0.1:0"))
    yield servicer, port
    server.stop(None)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed; it makes the test certificates")
    d = tmp_path_factory.mktemp("certs")
    (d / "openssl.cnf").write_text(
        "[req]\ndistinguished_name = dn\nprompt = no\n[dn]\nCN = tandem-test-ca\n"
        "[v3_ca]\nbasicConstraints = critical, CA:TRUE\nkeyUsage = critical, keyCertSign, cRLSign\n"
        "subjectKeyIdentifier = hash\n"
        f"[server]\nsubjectAltName = DNS:{SERVER_NAME}\nbasicConstraints = CA:FALSE\n"
        "keyUsage = critical, digitalSignature, keyEncipherment\nextendedKeyUsage = serverAuth, clientAuth\n"
    )
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    openssl(
        "req",
        "-x509",
        "-new",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-config",
        "openssl.cnf",
        "-extensions",
        "v3_ca",
    )
    openssl(
        "req", "-new", *ec, "-keyout", "tls.key", "-out", "tls.csr", "-config", "openssl.cnf", "-subj", "/CN=engine"
    )
    openssl(
        "x509",
        "-req",
        "-in",
        "tls.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "tls.crt",
        "-days",
        "2",
        "-extfile",
        "openssl.cnf",
        "-extensions",
        "server",
    )
    return d


@pytest.fixture
def mtls_server(certs):
    credentials = grpc.ssl_server_credentials(
        [((certs / "tls.key").read_bytes(), (certs / "tls.crt").read_bytes())],
        root_certificates=(certs / "ca.crt").read_bytes(),
        require_client_auth=True,
    )
    server, servicer, port = _serve(lambda s: s.add_secure_port("127.0.0.1:0", credentials))
    yield servicer, port
    server.stop(None)


def test_probe_plaintext_follows_serving_status(plaintext_server, capsys):
    servicer, port = plaintext_server
    assert probe.main(["--plaintext", "--port", str(port)]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert probe.main(["--plaintext", "--port", str(port)]) == 1
    assert capsys.readouterr().out.strip() == "NOT_SERVING"


def test_probe_fails_when_nothing_listens():
    with socket.socket() as sock:  # a port that was free a moment ago
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert probe.main(["--plaintext", "--port", str(port), "--timeout", "2"]) == 1


def test_probe_mtls_with_the_pods_own_certificate(mtls_server, certs):
    # What the chart runs in an engine pod: the engine's certificate doubles as the client one.
    _, port = mtls_server
    args = ["--port", str(port), "--ca", str(certs / "ca.crt"), "--server-name", SERVER_NAME, "--timeout", "5"]
    assert probe.main([*args, "--cert", str(certs / "tls.crt"), "--key", str(certs / "tls.key")]) == 0


def test_probe_mtls_without_client_certificate_fails(mtls_server, certs):
    _, port = mtls_server
    args = ["--port", str(port), "--ca", str(certs / "ca.crt"), "--server-name", SERVER_NAME, "--timeout", "5"]
    assert probe.main(args) == 1


def test_probe_rejects_wrong_server_name(mtls_server, certs):
    _, port = mtls_server
    args = [
        "--port",
        str(port),
        "--ca",
        str(certs / "ca.crt"),
        "--server-name",
        "other.example",
        "--timeout",
        "5",
        "--cert",
        str(certs / "tls.crt"),
        "--key",
        str(certs / "tls.key"),
    ]
    assert probe.main(args) == 1


def test_probe_runs_as_a_script(plaintext_server):
    _, port = plaintext_server
    result = subprocess.run(
        [sys.executable, str(DOCKER / "tandem-health-probe"), "--plaintext", "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (result.returncode, result.stdout.strip()) == (0, "SERVING"), result.stderr
