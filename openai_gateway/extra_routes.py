"""vLLM's routes beside the OpenAI API: /tokenize, /detokenize, /version, /metrics.

    POST /tokenize    {"prompt": "..."} or {"messages": [...]}  -> {"count", "max_model_len", "tokens"}
    POST /detokenize  {"tokens": [ids]}                          -> {"prompt"}
    GET  /version                                                -> {"version"}
    GET  /metrics     the scheduler's and executor's Prometheus metrics (--metrics-upstream), one page

The gateway holds no metrics of its own: the engine's live in the scheduler
and the executor, which serve them on their --metrics-listen ports; /metrics
fetches those pages and serves them together, so a Prometheus that can reach
only the HTTP port (as with vLLM) scrapes everything there.
"""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from openai_gateway.translate import APIError, _bad, _message, _token_ids, _typed, from_grpc

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def package_version() -> str:
    from pagedserve_client.cli import version

    return version()


async def tokenize(gw, request: Request, body: dict, md: tuple) -> Response:
    """`md`: the caller's credentials, passed through to the scheduler."""
    if body.get("model") is not None:
        await gw._check_model(request, body["model"])
    try:
        if body.get("messages") is not None:
            messages = body["messages"]
            if not isinstance(messages, list) or not messages:
                raise _bad("messages", "expected a non-empty list of messages")
            ids = await gw.client.tokenize(messages=[_message(i, m) for i, m in enumerate(messages)], metadata=md)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise _bad("prompt", "expected a string (or send messages)")
            add = _typed(body, "add_special_tokens", bool, "a boolean")
            ids = await gw.client.tokenize(prompt, True if add is None else add, metadata=md)
        info = await gw.client.model_info(metadata=md)
    except grpc.RpcError as e:
        raise from_grpc(e, {"prompt.chat": "messages", "text": "prompt"}) from e
    return JSONResponse(
        {"count": len(ids), "max_model_len": info.max_model_len_tokens, "tokens": ids, "token_strs": None}
    )


async def detokenize(gw, request: Request, body: dict, md: tuple) -> Response:
    if body.get("model") is not None:
        await gw._check_model(request, body["model"])
    tokens = body.get("tokens")
    if tokens != [] and _token_ids(tokens) is None:
        raise _bad("tokens", "expected a list of token ids")
    try:
        text = await gw.client.detokenize(tokens, metadata=md)
    except grpc.RpcError as e:
        raise from_grpc(e, {"token_ids": "tokens"}) from e
    return JSONResponse({"prompt": text})


async def metrics(upstream: tuple[str, ...]) -> Response:
    if not upstream:
        raise APIError(
            404,
            "metrics are not configured: start the gateway with --metrics-upstream (pagedserve serve does)",
            None,
            "not_found",
        )

    def fetch(address: str) -> str:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
            return r.read().decode()

    pages = await asyncio.gather(*(asyncio.to_thread(fetch, a) for a in upstream), return_exceptions=True)
    failed = [a for a, p in zip(upstream, pages) if isinstance(p, BaseException)]
    if failed:
        raise APIError(503, f"metrics unavailable from {', '.join(failed)}", None, "service_unavailable")
    return Response("".join(p if p.endswith("\n") else p + "\n" for p in pages), media_type=PROMETHEUS_TEXT)
