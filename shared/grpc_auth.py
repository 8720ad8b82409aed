"""Bearer-token authentication for gRPC servers (both services).

Every call must carry `authorization: Bearer <token>` matching one of the
accepted tokens, compared in constant time; the standard health service stays
open so orchestrators can probe without secrets.
"""
from __future__ import annotations

import hmac

import grpc

_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: tuple[str, ...]):
        if not tokens:
            raise ValueError("BearerAuthInterceptor needs at least one token")
        self._expected = [f"Bearer {t}".encode() for t in tokens]

    def _allowed(self, metadata) -> bool:
        got = b""
        for key, value in metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else value
        # Compare against every token so timing does not reveal which one matched.
        ok = False
        for expected in self._expected:
            ok |= hmac.compare_digest(got, expected)
        return ok

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler_call_details.method.startswith(_OPEN_PREFIXES) or self._allowed(handler_call_details.invocation_metadata):
            return handler
        if handler is None:
            return None

        async def deny_unary(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
            yield  # pragma: no cover - makes this an async generator

        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, handler.response_streaming)]
        deny = deny_stream if handler.response_streaming else deny_unary
        return make(deny, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
