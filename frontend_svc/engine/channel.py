"""The gRPC side of reaching one engine: its channel (keepalive, reconnect backoff, TLS)
and its tokenizer files (GetTokenizer), for EngineClient (client.py)."""

from __future__ import annotations

import asyncio
import hashlib

import grpc

from frontend_svc.types import CallError
from tandem_common.tokenizer_files import TOKENIZER_FILE_NAMES
from tandem_common.types import ErrorCode
from tandem_protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc

# A ping every 10 s, answered within 10 s (both the keepalive and the general HTTP/2 ping
# timeout, which is 60 s unless set): a dead peer is noticed within 20 s at worst.
KEEPALIVE_MS = 10_000
BACKOFF_INITIAL_S = 0.05
BACKOFF_CAP_S = 2.0
RPC_TIMEOUT_S = 10.0
TOKENIZER_TIMEOUT_S = 120
LORA_ADMIN_TIMEOUT_S = 90.0  # a LoRA load or unload, past the engine's own 60 s deadline for it


def open_channel(
    address: str, credentials: grpc.ChannelCredentials | None, tls_server_name: str | None, max_message_bytes: int
) -> grpc.aio.Channel:
    options: list[tuple[str, int | str]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.initial_reconnect_backoff_ms", int(BACKOFF_INITIAL_S * 1000) or 1),
        ("grpc.min_reconnect_backoff_ms", int(BACKOFF_INITIAL_S * 1000) or 1),
        ("grpc.max_reconnect_backoff_ms", int(BACKOFF_CAP_S * 1000)),
    ]
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    if tls_server_name:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    return grpc.aio.secure_channel(address, credentials, options=options)


def engine_credentials(ca: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials:
    """TLS to engines; with cert and key also a client certificate (mutual TLS)."""

    def read(path: str | None) -> bytes | None:
        return None if path is None else open(path, "rb").read()

    return grpc.ssl_channel_credentials(read(ca), read(key), read(cert))


async def tokenizer_digests(stub: engine_pb2_grpc.EngineServiceStub) -> tuple[tuple[str, str], ...]:
    """(file name, sha256) of the engine's tokenizer files that the frontend reads."""
    digests: dict[str, str] = {}
    try:
        async for chunk in stub.GetTokenizer(engine_pb2.GetTokenizerRequest(), timeout=TOKENIZER_TIMEOUT_S):
            if chunk.file_name in TOKENIZER_FILE_NAMES:
                digests[chunk.file_name] = chunk.sha256.lower()
    except grpc.aio.AioRpcError as e:
        if e.code() is not grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: the engine has no tokenizer files
            raise
    return tuple(sorted(digests.items()))


async def fetch_tokenizer_files(stub: engine_pb2_grpc.EngineServiceStub) -> dict[str, bytes]:
    """The tokenizer files, each checked against its size and sha256 ({} if the engine has none)."""
    files: dict[str, bytearray] = {}
    digests: dict[str, tuple[int, str]] = {}
    try:
        async for chunk in stub.GetTokenizer(engine_pb2.GetTokenizerRequest(), timeout=TOKENIZER_TIMEOUT_S):
            buf = files.setdefault(chunk.file_name, bytearray())
            if chunk.offset != len(buf):
                raise ValueError(f"{chunk.file_name}: chunk at offset {chunk.offset}, expected {len(buf)}")
            buf.extend(chunk.data)
            digests[chunk.file_name] = (chunk.total_size, chunk.sha256)
    except grpc.aio.AioRpcError as e:
        if e.code() is not grpc.StatusCode.NOT_FOUND:
            raise
        return {}
    for name, buf in files.items():
        size, digest = digests[name]
        if len(buf) != size:
            raise ValueError(f"{name}: got {len(buf)} bytes, the engine announced {size}")
        actual = hashlib.sha256(buf).hexdigest()
        if actual != digest.lower():
            raise ValueError(f"{name}: sha256 {actual} does not match the engine's {digest}")
    return {name: bytes(buf) for name, buf in files.items()}


async def load_lora(stub: engine_pb2_grpc.EngineServiceStub | None, address: str, name: str, path: str) -> None:
    """LoadLoraAdapter on one engine; CallError with the engine's status and its words."""
    await _lora_admin(stub, address, "LoadLoraAdapter", engine_pb2.LoadLoraAdapterRequest(name=name, path=path))


async def unload_lora(stub: engine_pb2_grpc.EngineServiceStub | None, address: str, name: str) -> None:
    """UnloadLoraAdapter on one engine; CallError with the engine's status and its words."""
    await _lora_admin(stub, address, "UnloadLoraAdapter", engine_pb2.UnloadLoraAdapterRequest(name=name))


async def _lora_admin(stub: engine_pb2_grpc.EngineServiceStub | None, address: str, method: str, request) -> None:
    if stub is None:
        raise CallError(ErrorCode.UNAVAILABLE, f"engine {address} is not connected")
    try:
        # The engine's own deadline for the load (LORA_RPC_TIMEOUT_S, 60 s) comes first.
        await getattr(stub, method)(request, timeout=LORA_ADMIN_TIMEOUT_S)
    except grpc.aio.AioRpcError as e:
        code = ErrorCode.__members__.get(e.code().name, ErrorCode.UNAVAILABLE)
        raise CallError(code, f"engine {address}: {e.details()}") from None


async def drain(outbox: asyncio.Queue):
    """A stream's requests: what the client puts in its outbox, in order, for as long as it lasts."""
    while True:
        yield await outbox.get()
