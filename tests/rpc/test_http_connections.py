"""HTTP connections are bounded as nginx bounds them, against a real pair on 127.0.0.1.

Sockets that hold a connection without finishing a request (never a byte, a head sent one
line at a time, a body that never comes) are closed after their deadlines (408 for the
head and the body) and never lock other clients out: the connection limit is its own,
well above the call limit, and each client address has a cap. Heads over the byte or the
field limit get 431; a stream whose client reads nothing is closed after the stalled-client
timeout and its engine requests aborted; strings that are not Unicode get 400 naming their
field. Small deadlines (1-2 s) keep each test to a few seconds; raw sockets from other
loopback addresses (127.0.0.2, ...) play the attackers.
"""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import time

import grpc
import httpx
import pytest

from tandem_protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc
from tests.rpc.http_face import http_base
from tests.services import start_frontend

CALL_LIMIT = 8
PER_ADDRESS = 10
MAX_CONNECTIONS = 24
FRONTEND_ARGS = (
    "--http-port",
    "0",
    "--max-concurrent-calls",
    str(CALL_LIMIT),
    "--http-idle-timeout-s",
    "1",
    "--http-header-timeout-s",
    "1",
    "--http-body-timeout-s",
    "1",
    "--stalled-client-timeout-s",
    "2",
    "--http-max-connections",
    str(MAX_CONNECTIONS),
    "--http-max-connections-per-address",
    str(PER_ADDRESS),
    "--http-max-header-fields",
    "64",
)


@pytest.fixture(scope="module")
def served(engine_proc):
    frontend = start_frontend(engine_proc.address, extra=FRONTEND_ARGS)
    try:
        base = http_base(frontend)
        yield engine_proc, frontend, base, int(base.rsplit(":", 1)[1])
    finally:
        frontend.terminate()


def _connect(port: int, source: str = "127.0.0.1", rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    s.settimeout(10)
    return s


def _read_to_close(s: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (AssertionError if it does not)."""
    s.settimeout(timeout)
    data = b""
    try:
        while chunk := s.recv(1 << 16):
            data += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"the server kept the connection open {timeout} s; it sent {data[:200]!r}") from None
    finally:
        s.close()
    return data


def _post_head(path: str, body_length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: {body_length}\r\n\r\n"
    ).encode()


def _engine_load(address: str) -> engine_pb2.EngineLoad:
    with grpc.insecure_channel(address) as channel:
        return engine_pb2_grpc.EngineServiceStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=5).load


def _victim(base: str) -> httpx.Response:
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0.0}
    return httpx.post(base + "/v1/completions", json=body, timeout=30)


def test_idle_sockets_neither_lock_out_other_clients_nor_stay(served):
    _, _, base, port = served
    # More silent sockets than the call limit, from two addresses, each at its cap.
    idle = [_connect(port, source) for source in ("127.0.0.2", "127.0.0.3") for _ in range(PER_ADDRESS)]
    t0 = time.monotonic()
    assert _victim(base).status_code == 200  # main: 503 while the sockets sit there
    over_cap = _read_to_close(_connect(port, "127.0.0.2"))
    assert over_cap.startswith(b"HTTP/1.1 503") and b"--http-max-connections-per-address" in over_cap
    for s in idle:
        assert _read_to_close(s) == b""  # closed without an answer: nothing was asked
    assert time.monotonic() - t0 < 8  # --http-idle-timeout-s 1, with room for a loaded machine


def test_the_connection_limit_answers_503_past_it(served):
    _, _, base, port = served
    held = [_connect(port, f"127.0.0.{4 + i // PER_ADDRESS}") for i in range(MAX_CONNECTIONS)]
    try:
        refused = _read_to_close(_connect(port, "127.0.0.9"))
        assert refused.startswith(b"HTTP/1.1 503") and b"(--http-max-connections)" in refused
        assert b"retry-after: 1" in refused
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while (status := _victim(base).status_code) != 200 and time.monotonic() < deadline:
        time.sleep(0.2)  # the server sees the closes a moment later
    assert status == 200


def test_trickled_heads_and_stuck_bodies_get_408_and_are_closed(served):
    _, _, base, port = served
    trickled = [_connect(port, "127.0.0.2") for _ in range(CALL_LIMIT)]
    stuck = [_connect(port, "127.0.0.3") for _ in range(CALL_LIMIT)]
    for s in trickled:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\n")
    for s in stuck:
        s.sendall(_post_head("/v1/completions", 100) + b'{"prompt": ')
    t0 = time.monotonic()
    assert _victim(base).status_code == 200  # main: 503
    for _ in range(3):  # a header line every 0.3 s: still no more than the head's deadline
        for s in trickled:
            try:
                s.sendall(b"x-slow: 1\r\n")
            except OSError:
                pass  # closed already
        time.sleep(0.3)
    for s, what in [(s, b"head") for s in trickled] + [(s, b"body") for s in stuck]:
        answer = _read_to_close(s)
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert b"the request's " + what + b" did not arrive within 1 s" in answer
    assert time.monotonic() - t0 < 10


def test_heads_over_the_byte_or_field_limit_get_431(served):
    _, _, _, port = served
    big = _connect(port)
    big.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\nx-big: " + b"a" * 70_000 + b"\r\n\r\n")  # main: 200
    answer = _read_to_close(big)
    assert answer.startswith(b"HTTP/1.1 431 ") and b"65536 bytes (--http-max-header-bytes)" in answer
    many = _connect(port)
    many.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\n" + b"".join(b"x-%d: a\r\n" % i for i in range(3000)) + b"\r\n")
    answer = _read_to_close(many)
    assert answer.startswith(b"HTTP/1.1 431 ") and b"3001 header fields" in answer  # main: 200


def test_a_stream_whose_client_reads_nothing_is_closed_and_its_requests_aborted(served):
    engine, frontend, _, port = served
    body = json.dumps(
        {"prompt": "hello", "max_tokens": 1900, "n": 16, "logprobs": 20, "stream": True, "ignore_eos": True}
    ).encode()
    s = _connect(port, rcvbuf=4096)
    s.sendall(_post_head("/v1/completions", len(body)) + body)
    deadline = time.monotonic() + 90
    while (load := _engine_load(engine.address)).num_running == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert load.num_running > 0
    # The socket's buffers fill within seconds; 2 s later the frontend closes the connection
    # and aborts the requests (main: the engine computes all 16 to their end, ~30 s here).
    while load.num_running + load.num_waiting + load.num_paused and time.monotonic() < deadline:
        time.sleep(0.2)
        load = _engine_load(engine.address)
    assert load.num_running + load.num_waiting + load.num_paused == 0, load
    received = _read_to_close(s)  # what the buffers held, then the close
    assert received.startswith(b"HTTP/1.1 200 ") and b"data: [DONE]" not in received  # main: the whole stream
    assert "read none of its response for 2 s while output waited (--stalled-client-timeout-s)" in frontend.log()


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages[0].content"),
        ("/v1/completions", '{"prompt": "\\udfff", "max_tokens": 2}', "prompt"),
        ("/v1/completions", '{"prompt": "a", "stop": ["ok", "x\\uDC00"]}', "stop[1]"),
        ("/v1/messages", '{"max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800"}]}', None),
        ("/tokenize", '{"prompt": "a", "\\ud800": 1}', "\\ud800"),
    ],
)
def test_lone_surrogates_get_400_naming_the_field(served, path, body, param):
    response = httpx.post(served[2] + path, content=body.encode(), timeout=30)
    assert response.status_code == 400, response.text  # main: 500
    error = response.json()["error"]
    if param is not None:
        assert error["param"] == param and error["message"].startswith(f"{param}: holds a lone UTF-16 surrogate")
    else:  # Anthropic's shape names the field in its message
        assert error["message"].startswith("messages[0].content: holds a lone UTF-16 surrogate")


def test_a_surrogate_pair_is_text(served):
    body = '{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2, "temperature": 0}'
    assert httpx.post(served[2] + "/v1/completions", content=body.encode(), timeout=30).status_code == 200


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_the_deadlines_hold_over_tls(engine_proc, tmp_path):
    from tests.rpc.test_frontend_tls import make_pki

    pki = make_pki(tmp_path)
    tls = ("--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"))
    frontend = start_frontend(engine_proc.address, extra=(*tls, *FRONTEND_ARGS))
    try:
        port = int(http_base(frontend).rsplit(":", 1)[1])
        context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        idle = context.wrap_socket(_connect(port), server_hostname="localhost")  # the handshake, then nothing
        head = context.wrap_socket(_connect(port), server_hostname="localhost")
        head.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\n")
        t0 = time.monotonic()
        assert _read_to_close(idle) == b""
        assert _read_to_close(head).startswith(b"HTTP/1.1 408 ")
        assert time.monotonic() - t0 < 8
    finally:
        frontend.terminate()
