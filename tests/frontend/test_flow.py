"""Calls in progress: a send on a call that already ended is the end of the call, not a failure."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc._cython import cygrpc

from frontend_svc.service.flow import Call, call_over


class EndedCall:
    """A servicer context whose call ended (the client cancelled) before gRPC told the
    handler: sending on it fails as grpc.aio's does, with an ExecuteBatchError."""

    async def write(self, response) -> None:
        raise cygrpc.ExecuteBatchError('Failed "execute_batch": (SendMessageOperation,)')


async def test_a_write_to_a_call_that_ended_raises_what_the_cancel_would_have():
    """grpc.aio logs an ExecuteBatchError escaping a handler with a traceback (unless its
    own notice of the cancel came first); the handler's CancelledError path is quiet."""
    call = Call(asyncio.current_task())
    with pytest.raises(asyncio.CancelledError) as raised:
        await call.write(EndedCall(), object())
    assert isinstance(raised.value.__cause__, grpc.aio.InternalError)


def test_the_cancellation_says_why():
    error = call_over(cygrpc.ExecuteBatchError("Failed"))
    assert isinstance(error, asyncio.CancelledError) and "ended before gRPC could send" in str(error)
