"""The HTTP face with --workers 2 (one port the parent picks and reports), with TLS, and its drain on SIGTERM."""

from __future__ import annotations

import json
import shutil
import signal
import ssl

import httpx
import pytest

from tests.rpc.http_face import http_base
from tests.services import start_frontend


def test_two_workers_serve_the_http_port(engine_proc):
    frontend = start_frontend(engine_proc.address, extra=("--workers", "2", "--http-port", "0"))
    try:
        base = http_base(frontend)
        texts = []
        for i in range(8):  # a new connection each: the kernel spreads them over the workers
            with httpx.Client(base_url=base, timeout=60) as client:
                assert client.get("/health").status_code == 200
                body = {"prompt": f"Worker test {i}", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
                response = client.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
                texts.append(response.json()["choices"][0]["text"])
        assert all(texts)
        log = frontend.log()
        assert "HTTP API on" in log and log.count("HTTP API on") == 2, log
    finally:
        assert frontend.terminate() == 0


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_serves_https_with_the_grpc_certificate(engine_proc, tmp_path):
    from tests.rpc.test_frontend_tls import make_pki

    pki = make_pki(tmp_path)
    tls = ("--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"))
    frontend = start_frontend(engine_proc.address, extra=(*tls, "--http-port", "0"))
    try:
        base = http_base(frontend).replace("http://", "https://")
        with httpx.Client(
            base_url=base, verify=ssl.create_default_context(cafile=str(pki / "ca.pem")), timeout=60
        ) as client:
            assert client.get("/health").status_code == 200
            body = {"prompt": "Secure", "max_tokens": 3}
            assert len(client.post("/v1/completions", json=body).json()["choices"]) == 1
        with pytest.raises(httpx.TransportError):  # plaintext to the TLS port
            httpx.get(base.replace("https://", "http://") + "/health", timeout=10)
    finally:
        frontend.terminate()


def test_sigterm_lets_an_http_stream_finish(engine_proc):
    frontend = start_frontend(engine_proc.address, extra=("--http-port", "0"))
    try:
        base = http_base(frontend)
        body = {"prompt": "hi", "max_tokens": 100, "temperature": 0.0, "ignore_eos": True, "stream": True}
        body["stream_options"] = {"include_usage": True}
        lines = []
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if not lines:
                    frontend.proc.send_signal(signal.SIGTERM)  # the drain lets this stream end whole
                if line:
                    lines.append(line)
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 100
        assert frontend.proc.wait(30) == 0
    finally:
        frontend.terminate()
