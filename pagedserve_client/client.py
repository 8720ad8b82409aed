"""A small client for `pagedserve.v1.Generation`, sync and asyncio.

from pagedserve_client import Client
with Client("127.0.0.1:50051") as c:
    for msg in c.generate("Why is the sky blue?", max_tokens=64):
        print(msg.text, end="", flush=True)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator

import grpc

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from pagedserve_client.errors import from_rpc_error
from pagedserve_client.results import Completion

_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "n",
)
_STOPPING = ("max_tokens", "min_tokens", "ignore_eos", "include_stop_str_in_output")


def build_request(
    prompt: str | None = None,
    *,
    token_ids=None,
    messages=None,
    request_id: str = "",
    stop: str | list[str] | tuple[str, ...] | None = (),
    stop_token_ids=(),
    priority: int = 0,
    constraint: pb.OutputConstraint | None = None,
    logit_bias: dict[int, float] | None = None,
    **kwargs,
) -> pb.GenerateRequest:
    """One of prompt / token_ids / messages ([{"role":..., "content":...}]), plus sampling and stopping kwargs,
    an optional structured-output constraint and a {token id: bias} logit_bias.
    `stop` is one stop string or a list of them (as in OpenAI's API)."""
    if sum(x is not None for x in (prompt, token_ids, messages)) != 1:
        raise ValueError("pass exactly one of prompt, token_ids, messages")
    unknown = set(kwargs) - set(_SAMPLING) - set(_STOPPING)
    if unknown:
        raise TypeError(f"unknown arguments: {', '.join(sorted(unknown))}")
    req = pb.GenerateRequest(request_id=request_id, priority=priority)
    if prompt is not None:
        req.text = prompt
    elif token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    else:
        req.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    for group, names in ((req.sampling, _SAMPLING), (req.stopping, _STOPPING)):
        for name in names:
            value = kwargs.get(name)
            if value is not None:
                try:
                    setattr(group, name, value)
                except (TypeError, ValueError, OverflowError) as e:  # e.g. a negative or too large integer
                    raise ValueError(f"{name}={value!r}: {e}") from None
    # A str is itself a sequence of strings: without this, stop="END" would stop at "E", "N" or "D".
    req.stopping.stop.extend([stop] if isinstance(stop, str) else (stop or ()))
    req.stopping.stop_token_ids.extend(stop_token_ids)
    if constraint is not None:
        req.constraint.CopyFrom(constraint)
    for token, bias in (logit_bias or {}).items():
        req.sampling.logit_bias[token] = bias
    return req


def _typed_errors(method):
    """Raises a `PagedServeError` (errors.py) in place of grpc's raw call error."""
    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def wrapper(*args, **kwargs):
            try:
                return await method(*args, **kwargs)
            except grpc.RpcError as e:
                raise from_rpc_error(e) from None
    else:

        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            try:
                return method(*args, **kwargs)
            except grpc.RpcError as e:
                raise from_rpc_error(e) from None

    return wrapper


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def _credentials(tls_ca: str | None, tls_cert: str | None = None, tls_key: str | None = None):
    """TLS when any of the three is given; tls_cert + tls_key present a client certificate (mutual TLS)."""
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("tls_cert and tls_key go together")
    if tls_ca is None and tls_cert is None:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls_ca), private_key=_read(tls_key), certificate_chain=_read(tls_cert)
    )


def _metadata(token: str | None):
    return (("authorization", f"Bearer {token}"),) if token else ()


class GenerateStream:
    """A Generate call as an iterator of responses. `close()` (or leaving a
    `with` block) cancels the request, so the scheduler frees its KV blocks
    at once, as does dropping the last reference (grpc cancels a collected
    call too). Other call methods (`cancel`, `code`, `details`, ...) pass
    through."""

    def __init__(self, call):
        self._call = call

    def __iter__(self) -> GenerateStream:
        return self

    def __next__(self) -> Completion:
        try:
            return Completion.from_proto(next(self._call))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def close(self) -> None:
        call = self.__dict__.get("_call")
        if call is not None:
            call.cancel()  # a no-op once the call has ended

    __del__ = close

    def __getattr__(self, name):
        if name.startswith("__") or name == "_call":  # copy, pickle, a half-built object: no recursion
            raise AttributeError(name)
        return getattr(self._call, name)

    def __enter__(self) -> GenerateStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Client:
    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ):
        creds = _credentials(tls_ca, tls_cert, tls_key)
        self._channel = grpc.secure_channel(target, creds) if creds else grpc.insecure_channel(target)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._md = _metadata(token)

    def generate(self, prompt=None, *, timeout: float | None = None, **kwargs) -> GenerateStream:
        """Streams `Completion` deltas, one per server message (results.py)."""
        return GenerateStream(self._stub.Generate(build_request(prompt, **kwargs), timeout=timeout, metadata=self._md))

    def complete(self, prompt=None, *, timeout: float | None = None, **kwargs) -> list[Completion]:
        """Runs a request to the end; one Completion per sample (n of them)."""
        out: dict[int, Completion] = {}
        for msg in self.generate(prompt, timeout=timeout, **kwargs):
            out.setdefault(msg.index, Completion()).add(msg)
        return [out[i] for i in sorted(out)]

    @_typed_errors
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        req = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(self._stub.Tokenize(req, metadata=self._md).token_ids)

    @_typed_errors
    def detokenize(self, token_ids, skip_special_tokens: bool = True) -> str:
        req = pb.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return self._stub.Detokenize(req, metadata=self._md).text

    @_typed_errors
    def model_info(self) -> pb.ModelInfo:
        return self._stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self._md)

    @_typed_errors
    def server_status(self, include_requests: bool = False) -> pb.ServerStatus:
        return self._stub.GetServerStatus(
            pb.GetServerStatusRequest(include_requests=include_requests), metadata=self._md
        )

    @_typed_errors
    def health(self, service: str = "", timeout: float | None = None) -> int:
        """The standard gRPC health status (a `HealthCheckResponse.ServingStatus` value); needs no token."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        req = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(self._channel).Check(req, timeout=timeout).status

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncClient:
    """Every call takes `metadata`: extra (key, value) pairs sent with that call only, after the
    client's own (a gateway passes each caller's `authorization` this way; then give the client no token)."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        options: tuple = (),
    ):
        """`options`: grpc channel arguments, e.g. (("grpc.max_reconnect_backoff_ms", 2000),)."""
        creds = _credentials(tls_ca, tls_cert, tls_key)
        self._channel = (
            grpc.aio.secure_channel(target, creds, options=options)
            if creds
            else grpc.aio.insecure_channel(target, options=options)
        )
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._md = _metadata(token)

    async def generate(
        self, prompt=None, *, timeout: float | None = None, metadata=(), **kwargs
    ) -> AsyncIterator[Completion]:
        call = self._stub.Generate(
            build_request(prompt, **kwargs), timeout=timeout, metadata=self._md + tuple(metadata)
        )
        try:
            async for msg in call:
                yield Completion.from_proto(msg)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            # A consumer that stops early (or is cancelled) must not leave the request generating:
            # cancelling makes the scheduler free its KV blocks. A no-op once the call has ended.
            call.cancel()

    async def complete(self, prompt=None, *, timeout: float | None = None, metadata=(), **kwargs) -> list[Completion]:
        out: dict[int, Completion] = {}
        async for msg in self.generate(prompt, timeout=timeout, metadata=metadata, **kwargs):
            out.setdefault(msg.index, Completion()).add(msg)
        return [out[i] for i in sorted(out)]

    @_typed_errors
    async def tokenize(
        self, text: str | None = None, add_special_tokens: bool = True, *, messages=None, metadata=()
    ) -> list[int]:
        """The token ids of `text`, or of `messages` rendered through the chat template."""
        if messages is not None:
            req = pb.TokenizeRequest(
                chat=pb.Chat(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages])
            )
        else:
            req = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list((await self._stub.Tokenize(req, metadata=self._md + tuple(metadata))).token_ids)

    @_typed_errors
    async def detokenize(self, token_ids, skip_special_tokens: bool = True, *, metadata=()) -> str:
        req = pb.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return (await self._stub.Detokenize(req, metadata=self._md + tuple(metadata))).text

    @_typed_errors
    async def server_status(self, include_requests: bool = False, *, metadata=()) -> pb.ServerStatus:
        req = pb.GetServerStatusRequest(include_requests=include_requests)
        return await self._stub.GetServerStatus(req, metadata=self._md + tuple(metadata))

    @_typed_errors
    async def model_info(self, *, metadata=()) -> pb.ModelInfo:
        return await self._stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self._md + tuple(metadata))

    @_typed_errors
    async def health(self, service: str = "", timeout: float | None = None) -> int:
        """The standard gRPC health status (a `HealthCheckResponse.ServingStatus` value); needs no token."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        req = health_pb2.HealthCheckRequest(service=service)
        return (await health_pb2_grpc.HealthStub(self._channel).Check(req, timeout=timeout)).status

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
