"""How messages cross the gRPC edge: corrupt requests get INVALID_ARGUMENT, not
UNKNOWN, a handler's unexpected failure INTERNAL, and a handler may answer
with an already serialized response.

Requests. grpcio turns an exception raised by a request deserializer (protobuf's
DecodeError: bad wire format, a string field that is not UTF-8) into UNKNOWN
"Unexpected <class DecodeError>". That is the client's fault, so this
interceptor wraps each unary-request method's deserializer: a message that does
not parse becomes a marker, and the method answers INVALID_ARGUMENT before the
handler runs. Streaming-request methods are left as they are (handlers may read
them with `context.read()`, which an interceptor cannot reach).

Failures. An exception a handler did not turn into a status (a bug, not the
client's fault) would reach the client as UNKNOWN "Unexpected <class ...>";
here it is logged with its traceback and answered INTERNAL, the one place
that does so. Only that call ends: the server and every other call go on.

Responses. grpcio serializes a handler's response on the event loop, in one C
call that holds the GIL: for a response of millions of elements that stalls
every other call for a large fraction of a second. A handler may instead
return `bytes` it serialized itself (in a worker thread, in chunks: the
concatenation of serialized messages is their merge), passed through as is.
"""

from __future__ import annotations

import inspect

import grpc
import structlog
from google.protobuf.message import DecodeError

log = structlog.get_logger(__name__)


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


async def _internal(context, error: Exception, method: str):
    """Answers INTERNAL for an exception the handler let through: logged here,
    named but not detailed to the client (its text may hold internals)."""
    log.error("handler_failed", method=method, exc_info=error)
    await context.abort(
        grpc.StatusCode.INTERNAL, f"internal error ({type(error).__name__}) in {method}; the server log has the details"
    )


def _unary_response(behavior, method: str):
    async def guarded(request, context):
        if isinstance(request, _Corrupt):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(request))
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await _internal(context, e, method)

    return guarded


def _stream_response(behavior, method: str):
    if inspect.isasyncgenfunction(behavior):

        async def guarded_gen(request, context):
            if isinstance(request, _Corrupt):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(request))
            try:
                async for response in behavior(request, context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as e:
                await _internal(context, e, method)

        return guarded_gen
    return _unary_response(behavior, method)  # writes with context.write and returns


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
        method = handler_call_details.method
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                _stream_response(handler.unary_stream, method), deserialize, handler.response_serializer
            )
        return grpc.unary_unary_rpc_method_handler(
            _unary_response(handler.unary_unary, method), deserialize, _passing_bytes(handler.response_serializer)
        )
