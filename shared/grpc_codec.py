"""How messages cross the gRPC edge: corrupt requests get INVALID_ARGUMENT, not
UNKNOWN, and a handler may answer with an already serialized response.

Requests. grpcio turns an exception raised by a request deserializer (protobuf's
DecodeError: bad wire format, a string field that is not UTF-8) into UNKNOWN
"Unexpected <class DecodeError>". That is the client's fault, so this
interceptor wraps each unary-request method's deserializer: a message that does
not parse becomes a marker, and the method answers INVALID_ARGUMENT before the
handler runs. Streaming-request methods are left as they are (handlers may read
them with `context.read()`, which an interceptor cannot reach).

Responses. grpcio serializes a handler's response on the event loop, in one C
call that holds the GIL: for a response of millions of elements that stalls
every other call for a large fraction of a second. A handler may instead
return `bytes` it serialized itself (in a worker thread, in chunks: the
concatenation of serialized messages is their merge), passed through as is.
"""

from __future__ import annotations

import inspect

import grpc
from google.protobuf.message import DecodeError


class _Corrupt:
    __slots__ = ("error",)

    def __init__(self, error: str):
        self.error = error


def _safe(deserializer):
    def deserialize(raw: bytes):
        try:
            return deserializer(raw)
        except DecodeError as e:
            return _Corrupt(str(e))

    return deserialize


def _message(corrupt: _Corrupt) -> str:
    return f"the request message does not parse: {corrupt.error}"


def _unary_response(behavior):
    async def guarded(request, context):
        if isinstance(request, _Corrupt):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(request))
        return await behavior(request, context)

    return guarded


def _stream_response(behavior):
    if inspect.isasyncgenfunction(behavior):

        async def guarded_gen(request, context):
            if isinstance(request, _Corrupt):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(request))
            async for response in behavior(request, context):
                yield response

        return guarded_gen
    return _unary_response(behavior)  # writes with context.write and returns


def _passing_bytes(serializer):
    if serializer is None:
        return None

    def serialize(response) -> bytes:
        return response if type(response) is bytes else serializer(response)

    return serialize


class CodecInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        deserialize = _safe(handler.request_deserializer)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                _stream_response(handler.unary_stream), deserialize, handler.response_serializer
            )
        return grpc.unary_unary_rpc_method_handler(
            _unary_response(handler.unary_unary), deserialize, _passing_bytes(handler.response_serializer)
        )
