"""Bearer-token authentication for gRPC servers (both services).

Every call must carry exactly one `authorization: Bearer <token>` header
matching one of the accepted tokens; the standard health service stays open so
orchestrators can probe without secrets. Failing closed:

- the scheme is compared case-insensitively (RFC 7235 section 2.1), the token exactly;
- two `authorization` headers are refused, never "last one wins";
- a call to an unknown method is authenticated first: without a valid token it
  gets UNAUTHENTICATED, so the method table is not probeable anonymously;
- a refused call's message is never parsed.

Each token names a `Caller`, so handlers can scope what a caller may see; an
admin token's caller may see everyone's. Tokens are compared through their
SHA-256 digests in constant time, against every accepted token, so timing
reveals neither a token's length nor which one matched.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

import grpc

_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
UNAUTHENTICATED_MESSAGE = "missing or invalid bearer token"


@dataclass(frozen=True)
class Caller:
    """Who made a call. `name` is not secret: it is derived from the token's digest."""

    name: str
    admin: bool = False


# Without authentication every call comes from the same caller, who therefore sees all requests.
ANONYMOUS = Caller("anonymous")


def _digest(token: str | bytes) -> bytes:
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


class TokenTable:
    """The accepted bearer tokens; `admin_tokens` is a subset of `tokens`."""

    def __init__(self, tokens: tuple[str, ...], admin_tokens: tuple[str, ...] = ()):
        if not tokens:
            raise ValueError("a TokenTable needs at least one token")
        if not set(admin_tokens) <= set(tokens):
            raise ValueError("every admin token must also be an accepted token")
        admins = set(admin_tokens)
        self._entries = [
            (_digest(t), Caller(f"token-{hashlib.sha256(t.encode()).hexdigest()[:12]}", t in admins)) for t in tokens
        ]

    def identify(self, metadata) -> Caller | None:
        """The caller named by the call's metadata, or None to refuse the call."""
        values = [v for k, v in metadata or () if k == "authorization"]
        if len(values) != 1:
            return None
        value = values[0].decode("latin-1") if isinstance(values[0], bytes) else values[0]
        scheme, _, credentials = value.partition(" ")
        got = _digest(credentials.strip(" "))
        bearer = scheme.lower() == "bearer"
        found = None
        for digest, caller in self._entries:  # every entry, whatever matches first
            if hmac.compare_digest(got, digest) and bearer:
                found = caller
        return found


async def _deny_unary(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)


async def _deny_stream(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
    yield  # pragma: no cover - makes this an async generator


_MAKE = {
    (False, False): (grpc.unary_unary_rpc_method_handler, _deny_unary),
    (False, True): (grpc.unary_stream_rpc_method_handler, _deny_stream),
    (True, False): (grpc.stream_unary_rpc_method_handler, _deny_unary),
    (True, True): (grpc.stream_stream_rpc_method_handler, _deny_stream),
}


def _denial(handler) -> grpc.RpcMethodHandler:
    # No deserializer: the refused message stays opaque bytes, never parsed.
    # An unknown method (handler None) is refused the same way, as a stream.
    kind = (handler.request_streaming, handler.response_streaming) if handler is not None else (True, True)
    make, deny = _MAKE[kind]
    return make(deny)


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: TokenTable | tuple[str, ...]):
        self.table = tokens if isinstance(tokens, TokenTable) else TokenTable(tuple(tokens))

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler_call_details.method.startswith(_OPEN_PREFIXES):
            return handler
        if self.table.identify(handler_call_details.invocation_metadata) is None:
            return _denial(handler)
        return handler
