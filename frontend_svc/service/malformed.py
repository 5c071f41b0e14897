"""Requests whose bytes do not parse get INVALID_ARGUMENT, as the public API promises.

A message with invalid UTF-8 in a string field or a corrupt wire format never comes
from a protobuf library, but a hand-written or broken client can send one. gRPC Python
answers a deserializer failure with UNKNOWN and the parser's exception text; this
interceptor parses leniently and refuses such a request itself, naming what was wrong.

Only the unary-request methods of GenerateService are wrapped: they are the public
surface, and their handlers are known to be coroutines (streaming ones may write with
``context.write``) or async generators.
"""

from __future__ import annotations

import inspect
import logging

import grpc

logger = logging.getLogger(__name__)


class _Undecodable:
    """Stands in for a request whose bytes did not parse."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _lenient(deserializer):
    def parse(data: bytes):
        try:
            return deserializer(data)
        except Exception as e:  # noqa: BLE001 - any parse failure is the client's bad input
            return _Undecodable(e)

    return parse


async def _refuse(request: _Undecodable, context: grpc.aio.ServicerContext) -> None:
    logger.info("refused a request that could not be parsed: %s", request.error)
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT, f"the request could not be parsed as a protobuf message: {request.error}"
    )


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, method_prefix: str) -> None:
        self._prefix = method_prefix

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if (
            handler is None
            or handler.request_streaming
            or handler.request_deserializer is None
            or not details.method.startswith(self._prefix)
        ):
            return handler
        parse = _lenient(handler.request_deserializer)
        if handler.response_streaming:
            inner_stream = handler.unary_stream

            async def unary_stream(request, context):
                if isinstance(request, _Undecodable):
                    await _refuse(request, context)
                result = inner_stream(request, context)
                if inspect.isasyncgen(result):
                    async for response in result:
                        await context.write(response)
                else:  # a handler that writes itself (context.write)
                    await result

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, request_deserializer=parse, response_serializer=handler.response_serializer
            )
        inner = handler.unary_unary

        async def unary_unary(request, context):
            if isinstance(request, _Undecodable):
                await _refuse(request, context)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, request_deserializer=parse, response_serializer=handler.response_serializer
        )
