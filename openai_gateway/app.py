"""HTTP routes: OpenAI's API on top of `pagedserve_client.AsyncClient`.

    GET  /v1/models, /v1/models/{id}   the scheduler's one model
    POST /v1/completions               a text or token-id prompt
    POST /v1/chat/completions          messages through the model's chat template
    GET  /health                       200 while the scheduler's gRPC health is SERVING, else 503
    /tokenize, /detokenize, /version, /metrics: vLLM's extra routes (extra_routes.py)

Nothing here schedules: each HTTP request is one `Generate` call, and the
caller's Authorization header rides along as gRPC metadata for the scheduler to
check. A client that disconnects cancels its gRPC call, which is what makes the
scheduler free the request's KV blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

import grpc
import structlog
from grpc_health.v1 import health_pb2
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from openai_gateway import extra_routes
from openai_gateway.config import GatewayConfig
from openai_gateway.merge_streams import merge_streams
from openai_gateway.translate import (
    COMPLETION,
    APIError,
    Translated,
    chat_request,
    chunk_json,
    completion_request,
    delta_chunk_json,
    from_grpc,
    logprob_token_ids,
    logprobs_json,
    response_json,
    usage_chunk_json,
)
from pagedserve_client import AsyncClient, Completion
from shared.model_id import model_id

log = structlog.get_logger("openai_gateway")
_DONE = "data: [DONE]\n\n"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _auth(request: Request) -> tuple:
    """The caller's credentials, passed through untouched: the scheduler is the one that checks them."""
    value = request.headers.get("authorization")
    return (("authorization", value),) if value else ()


async def _json_body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except RecursionError as e:  # nested deeper than Python's parser recurses
        raise APIError(400, "the request body is nested too deeply to parse") from e
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


class _ClientGone(Exception):
    pass


async def _wait_disconnect(request: Request) -> None:
    # The body has been read, so the server's next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, awaitable):
    """Awaits `awaitable`; if the HTTP client goes away first, cancels it (and with it the gRPC call)."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        finished = work.done()
        if not finished:
            work.cancel()
    if not finished:
        raise _ClientGone()
    return work.result()


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.client: AsyncClient | None = None  # made in `lifespan`: a grpc.aio channel belongs to its event loop
        self.started = int(time.time())
        self.names: set[str] = set()  # the model names requests may use; learnt from the scheduler

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        # gRPC's reconnect backoff grows to minutes while the scheduler is down; cap it so that
        # the gateway serves again within ~2 s of the scheduler coming back.
        self.client = AsyncClient(
            self.config.scheduler,
            tls_ca=self.config.scheduler_tls_ca or None,
            options=(("grpc.max_reconnect_backoff_ms", 2000),),
        )
        try:
            yield
        finally:
            await self.client.close()

    async def health(self, request: Request) -> Response:
        try:
            status = await self.client.health(timeout=2.0)
        except grpc.RpcError:
            status = health_pb2.HealthCheckResponse.UNKNOWN
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
        return JSONResponse(
            {"status": name}, status_code=200 if status == health_pb2.HealthCheckResponse.SERVING else 503
        )

    async def _model_card(self, request: Request) -> dict:
        try:
            info = await self.client.model_info(metadata=_auth(request))
        except grpc.RpcError as e:
            raise from_grpc(e, {}) from e
        self.names = (
            {self.config.served_model_name}
            if self.config.served_model_name
            else {model_id(info.model_name), info.model_name}
        )
        return {
            "id": self.config.served_model_name or model_id(info.model_name),
            "object": "model",
            "created": self.started,
            "owned_by": "pagedserve",
            "max_model_len": info.max_model_len_tokens,
        }

    async def _check_model(self, request: Request, name: str) -> None:
        """404 for a model this server does not serve (as vLLM and OpenAI answer)."""
        if not isinstance(name, str):
            raise APIError(400, f"model: expected a string, got {type(name).__name__}", "model")
        if not self.names:
            await self._model_card(request)  # learns the names once; the scheduler serves one model for its life
        if name not in self.names:
            served = self.config.served_model_name or min(self.names, key=len)
            raise APIError(
                404,
                f"The model `{name}` does not exist; this server serves `{served}`.",
                "model",
                "model_not_found",
                "NotFoundError",
            )

    async def list_models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [await self._model_card(request)]})

    async def get_model(self, request: Request) -> Response:
        card = await self._model_card(request)
        await self._check_model(request, request.path_params["model"])
        return JSONResponse(card)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, completion_request(await _json_body(request)))

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat_request(await _json_body(request)))

    async def _token_text(self, token_ids: set[int], metadata) -> dict[int, str]:
        """Each token's own text, for logprobs (the stream carries ids only). One small RPC per
        distinct id, concurrently: fine on the loopback hop, and only when logprobs are asked for."""
        ids = sorted(token_ids)
        texts = await asyncio.gather(
            *(self.client.detokenize([i], skip_special_tokens=False, metadata=metadata) for i in ids)
        )
        return dict(zip(ids, texts))

    async def _echoes(self, t: Translated, md) -> list[str]:
        """Per prompt, the text its choices start with: the prompt itself under `echo`, else nothing."""
        if not t.echo:
            return [""] * len(t.prompts)
        return list(
            await asyncio.gather(
                *(
                    _const(p["prompt"])
                    if "prompt" in p
                    else self.client.detokenize(p["token_ids"], skip_special_tokens=False, metadata=md)
                    for p in t.prompts
                )
            )
        )

    async def _generate(self, request: Request, t: Translated) -> Response:
        md = _auth(request)
        response_id = ("cmpl-" if t.kind == COMPLETION else "chatcmpl-") + uuid.uuid4().hex
        created = int(time.time())
        headers = {"x-request-id": response_id}
        # One Generate call per prompt; request ids stay unique on the scheduler.
        ids = [response_id] if len(t.prompts) == 1 else [f"{response_id}-{p}" for p in range(len(t.prompts))]
        try:
            await self._check_model(request, t.model)
            echoes = await self._echoes(t, md)
            if not t.stream:
                groups = await _unless_disconnected(
                    request,
                    _all_or_none(
                        self.client.complete(request_id=rid, metadata=md, **prompt, **t.kwargs)
                        for rid, prompt in zip(ids, t.prompts)
                    ),
                )
                samples = [s for g in groups for s in g]
                logprobs = [None] * len(samples)
                if t.logprobs:
                    text = await self._token_text(set().union(*(logprob_token_ids(s.logprobs) for s in samples)), md)
                    logprobs = [logprobs_json(t.kind, s.logprobs, text) for s in samples]
                return JSONResponse(response_json(t, response_id, created, groups, logprobs, echoes), headers=headers)
            # Wait for each prompt's first message before answering 200: a request the scheduler
            # rejects gets a proper HTTP error instead of an error event inside a started stream.
            gens = [
                self.client.generate(request_id=rid, metadata=md, **prompt, **t.kwargs)
                for rid, prompt in zip(ids, t.prompts)
            ]
            try:
                firsts = await _unless_disconnected(request, _all_or_none(anext(g) for g in gens))
            except BaseException:
                await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)
                raise
        except grpc.RpcError as e:
            raise from_grpc(e, t.renames) from e
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it; the gRPC calls are already cancelled
        return StreamingResponse(
            self._stream(t, response_id, created, list(zip(firsts, gens)), echoes, md),
            media_type="text/event-stream",
            headers={**headers, "cache-control": "no-cache"},
        )

    async def _stream(self, t: Translated, response_id: str, created: int, streams, echoes: list[str], md):
        """SSE chunks, one per gRPC message that carries something; prompt p's sample i is choice
        p*n+i. On disconnect the server cancels this generator, which cancels the gRPC calls."""
        samples: dict[int, Completion] = {}
        tool_state: dict = {}  # per-sample tool-call parsers (chat with tools)
        try:
            async for p, msg in merge_streams(streams):
                index = p * t.n + msg.index
                is_first = index not in samples
                sample = samples.setdefault(index, Completion())
                logprobs = None
                if t.logprobs and msg.logprobs:
                    text = await self._token_text(logprob_token_ids(msg.logprobs), md)
                    logprobs = logprobs_json(t.kind, msg.logprobs, text, offset=len(sample.text))
                sample.add(msg)
                finish = msg.finish_reason
                text = (echoes[p] if is_first else "") + msg.text
                if t.tools is not None:
                    for chunk in self._tool_chunks(
                        t, response_id, created, index, msg.text, finish, logprobs, is_first, tool_state
                    ):
                        yield _sse(chunk)
                elif text or logprobs or finish or is_first:
                    yield _sse(chunk_json(t, response_id, created, index, text, finish, logprobs, is_first))
            if t.include_usage:
                groups = [[samples[p * t.n + i] for i in range(t.n)] for p in range(len(streams))]
                yield _sse(usage_chunk_json(t, response_id, created, groups))
        except grpc.RpcError as e:
            # Headers are sent: the error travels as an event (the OpenAI client raises it).
            err = from_grpc(e, t.renames)
            log.warning("stream_failed", request_id=response_id, status=err.status, code=e.code().name)
            yield _sse(err.body())
        except Exception:  # a bug here, after the headers: end the stream with an error event, not mid-air
            log.exception("stream_internal_error", request_id=response_id)
            yield _sse(APIError(500, "internal error in the gateway").body())
        yield _DONE

    @staticmethod
    def _tool_chunks(
        t: Translated,
        response_id: str,
        created: int,
        index: int,
        text: str,
        finish,
        logprobs,
        is_first: bool,
        state: dict,
    ):
        """A sample's chunks when tools are on: content and tool-call deltas (tools.py), the
        first naming the role, the last carrying the finish_reason (tool_calls when it called)."""
        deltas, finish = t.tools.stream_deltas(state, index, text, finish)
        if is_first:
            deltas = [{"role": "assistant", **(deltas[0] if deltas else {"content": ""})}] + deltas[1:]
        if finish is not None or (logprobs and not deltas):
            deltas = deltas or [{}]
        for j, delta in enumerate(deltas):
            last = j == len(deltas) - 1
            yield delta_chunk_json(
                t, response_id, created, index, delta, finish if last else None, logprobs if j == 0 else None
            )


async def _all_or_none(awaitables):
    """asyncio.gather, except that the first failure cancels the rest: when one prompt of a
    list is refused, the others must not go on generating for nobody."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _const(value):
    return value


async def _api_error(request: Request, exc: APIError) -> Response:
    if exc.status >= 500:
        log.warning("request_failed", path=request.url.path, status=exc.status, message=exc.message)
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    err = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", None, code)
    return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("internal_error", path=request.url.path, error=repr(exc))
    return JSONResponse(APIError(500, "internal error in the gateway").body(), status_code=500)


def create_app(config: GatewayConfig) -> Starlette:
    gw = Gateway(config)

    async def tokenize(request: Request) -> Response:
        return await extra_routes.tokenize(gw, request, await _json_body(request), _auth(request))

    async def detokenize(request: Request) -> Response:
        return await extra_routes.detokenize(gw, request, await _json_body(request), _auth(request))

    async def version(request: Request) -> Response:
        return JSONResponse({"version": extra_routes.package_version()})

    async def metrics(request: Request) -> Response:
        return await extra_routes.metrics(config.metrics_upstream)

    routes = [
        Route("/health", gw.health, methods=["GET"]),
        Route("/v1/models", gw.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", gw.get_model, methods=["GET"]),
        Route("/v1/completions", gw.completions, methods=["POST"]),
        Route("/v1/chat/completions", gw.chat_completions, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/version", version, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    middleware = []
    if config.allowed_origins:
        # Browsers call from these origins; credentials stay off (the Authorization header still passes).
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(config.allowed_origins),
                allow_methods=["*"],
                allow_headers=["*"],
                expose_headers=["x-request-id"],
            )
        )
    handlers = {APIError: _api_error, HTTPException: _http_error, Exception: _internal_error}
    return Starlette(routes=routes, middleware=middleware, exception_handlers=handlers, lifespan=gw.lifespan)
