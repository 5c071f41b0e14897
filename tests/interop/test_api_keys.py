"""API keys on the frontend, seen from grpcurl: reflection and health stay open, every
GenerateService call needs ``authorization: Bearer KEY`` with an accepted key."""

from __future__ import annotations

import json

import pytest

from tests.grpcurl import run_grpcurl
from tests.services import start_frontend

GENERATE = "tandem.generate.v1.GenerateService"
CALLS = [
    ("Tokenize", {"text": "hi"}),
    ("Detokenize", {"token_ids": [5]}),
    ("GetModelInfo", {}),
    ("Generate", {"text": "hi", "sampling_params": {"max_tokens": 2, "ignore_eos": True}}),
]


@pytest.fixture(scope="module")
def keyed_frontend(services, tmp_path_factory):
    engine, _ = services
    key_file = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file.write_text("# one key per line\n\nkey-from-file\n")
    frontend = start_frontend(
        engine.address, extra=("--api-key", "key-one", "--api-key", "key-two", "--api-key-file", str(key_file))
    )
    try:
        yield frontend.wait_serving()  # the health check needs no key
    finally:
        frontend.terminate()


def grpcurl_as(address: str, header: str | None, *args: str, data: object | None = None):
    flags = ["-plaintext", "-max-time", "30"]
    if header is not None:
        flags += ["-H", header]
    if data is not None:
        flags += ["-d", json.dumps(data)]
    return run_grpcurl(*flags, address, *args)


def test_reflection_and_health_need_no_key(keyed_frontend):
    address = keyed_frontend.address
    listed = grpcurl_as(address, None, "list")
    assert listed.returncode == 0 and GENERATE in listed.stdout.split(), listed.stderr
    described = grpcurl_as(address, None, "describe", GENERATE)
    assert described.returncode == 0 and "rpc Generate" in described.stdout, described.stderr
    message = grpcurl_as(address, None, "describe", "tandem.generate.v1.GenerateRequest")
    assert message.returncode == 0 and "oneof input" in message.stdout, message.stderr
    health = grpcurl_as(address, None, "grpc.health.v1.Health/Check", data={"service": GENERATE})
    assert health.returncode == 0 and json.loads(health.stdout) == {"status": "SERVING"}, health.stderr


@pytest.mark.parametrize(
    "header",
    [
        None,
        "authorization: Bearer wrong-key",
        "authorization: key-one",  # no scheme
        "authorization: Basic key-one",  # the wrong scheme
        "authorization: Bearer ",
        "authorization: Bearer key-one-and-more",
        "x-api-key: wrong-key",
    ],
    ids=["none", "wrong", "no-scheme", "basic", "empty", "prefix", "x-api-key-wrong"],
)
def test_calls_without_a_valid_key_are_unauthenticated(keyed_frontend, header):
    for method, data in CALLS if header is None else CALLS[::3]:  # all, then Tokenize and Generate
        result = grpcurl_as(keyed_frontend.address, header, f"{GENERATE}/{method}", data=data)
        assert result.returncode != 0 and result.stdout == "", (method, result.stdout)
        assert "Code: Unauthenticated" in result.stderr, (method, result.stderr)
        assert "authorization: Bearer KEY" in result.stderr, (method, result.stderr)


@pytest.mark.parametrize(
    "header",
    [
        "authorization: Bearer key-one",
        "authorization: Bearer key-two",
        "authorization: Bearer key-from-file",
        "authorization: bearer key-one",
    ],
    ids=["flag-1", "flag-2", "file", "lowercase-scheme"],
)
def test_every_accepted_key_opens_the_calls(keyed_frontend, header):
    for method, data in CALLS if header == "authorization: Bearer key-one" else CALLS[::3]:
        result = grpcurl_as(keyed_frontend.address, header, f"{GENERATE}/{method}", data=data)
        assert result.returncode == 0, (method, result.stderr)


@pytest.mark.parametrize(
    "make_args",
    [
        lambda d: ("--api-key", ""),
        lambda d: ("--api-key", "   "),
        lambda d: ("--api-key-file", str(d / "empty-keys")),
        lambda d: ("--api-key-file", str(d / "missing-file")),
    ],
    ids=["empty-key", "blank-key", "key-file-without-keys", "missing-key-file"],
)
def test_authentication_cannot_be_switched_off_by_accident(tmp_path, make_args):
    (tmp_path / "empty-keys").write_text("# no key yet\n\n")
    frontend = start_frontend("127.0.0.1:1", extra=make_args(tmp_path))
    try:
        assert frontend.proc.wait(120) != 0  # a start-up that refuses; slow on a loaded machine
    finally:
        frontend.terminate()
    assert "--api-key" in frontend.log() and "listening" not in frontend.log()


def test_an_unauthenticated_caller_learns_nothing_about_its_request(keyed_frontend):
    """The key is checked before the request is even parsed: bytes that are no valid
    message get UNAUTHENTICATED without a key, INVALID_ARGUMENT with one."""
    import grpc

    with grpc.insecure_channel(keyed_frontend.address) as channel:
        tokenize = channel.unary_unary(f"/{GENERATE}/Tokenize")
        for metadata, code in (
            (None, grpc.StatusCode.UNAUTHENTICATED),
            ((("authorization", "Bearer key-two"),), grpc.StatusCode.INVALID_ARGUMENT),
        ):
            with pytest.raises(grpc.RpcError) as error:
                tokenize(b"\x0a\x02\xff\xfe", metadata=metadata, timeout=10)
            assert error.value.code() == code, error.value.details()
