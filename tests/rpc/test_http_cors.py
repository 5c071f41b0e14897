"""Browsers on other origins: preflights answered before the API key is asked for, the
allowed origins, methods and headers as vLLM's flags set them (raw httpx, as a browser
sends them)."""

from __future__ import annotations

import httpx
import pytest

from tests.rpc.http_face import API_KEY, http_base
from tests.services import start_frontend

PAGE = "https://app.example"


def _preflight(base: str, origin: str, method: str = "POST", headers: str = "authorization,content-type"):
    request_headers = {
        "origin": origin,
        "access-control-request-method": method,
        "access-control-request-headers": headers,
    }
    return httpx.options(base + "/v1/chat/completions", headers=request_headers, timeout=30)


@pytest.fixture(scope="module")
def open_base(engine_proc):
    frontend = start_frontend(engine_proc.address, extra=("--http-port", "0", "--api-key", API_KEY))
    try:
        yield http_base(frontend), frontend
    finally:
        frontend.terminate()


@pytest.fixture(scope="module")
def narrow_base(engine_proc):
    extra = (
        "--http-port",
        "0",
        "--api-key",
        API_KEY,
        "--allowed-origins",
        f'["{PAGE}"]',
        "--allowed-methods",
        '["GET", "POST"]',
        "--allowed-headers",
        '["authorization", "content-type"]',
    )
    frontend = start_frontend(engine_proc.address, extra=extra)
    try:
        yield http_base(frontend)
    finally:
        frontend.terminate()


def test_by_default_any_page_may_call_and_its_preflight_needs_no_key(open_base):
    base, frontend = open_base
    r = _preflight(base, "https://elsewhere.example", headers="authorization,x-stainless-os")
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "x-stainless-os" in r.headers["access-control-allow-headers"].lower()
    call = httpx.get(base + "/v1/models", headers={"origin": PAGE, "authorization": f"Bearer {API_KEY}"})
    assert call.status_code == 200 and call.headers["access-control-allow-origin"] == "*"
    assert "x-request-id" in call.headers["access-control-expose-headers"].lower()
    refused = httpx.get(base + "/v1/models", headers={"origin": PAGE})  # the page can read why
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"
    assert "CORS: origins *, methods *, headers *" in frontend.log()


def test_the_flags_narrow_origins_methods_and_headers(narrow_base):
    r = _preflight(narrow_base, PAGE)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE
    for refused in (
        _preflight(narrow_base, "https://elsewhere.example"),
        _preflight(narrow_base, PAGE, method="DELETE"),
        _preflight(narrow_base, PAGE, headers="authorization,x-other"),
    ):
        assert refused.status_code == 400
    call = httpx.get(narrow_base + "/v1/models", headers={"origin": "https://elsewhere.example", "x-api-key": API_KEY})
    assert call.status_code == 200 and "access-control-allow-origin" not in call.headers
