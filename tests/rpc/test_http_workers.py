"""--workers 2 --http-port 0: both workers serve the one HTTP port the parent picked and reports."""

from __future__ import annotations

import httpx

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
