"""Sends a workload over gRPC and records when each request's tokens arrive.

Every suite measures through here: one `AsyncClient`, one asyncio task per
request, each started at its arrival time (0 for "all at once") and timed with
`time.perf_counter` from the moment it is sent. The stream's messages are not
decoded beyond counting tokens, so the client steals little CPU from the
server it measures (both share the machine).

    sent ─── TTFT ───► first tokens ─ ITL ─► ... ─ ITL ─► last tokens
    └────────────────────────── E2E ─────────────────────────┘
    TPOT = (E2E - TTFT) / (output tokens - 1)
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from bench.workloads import BenchRequest
from pagedserve.v1 import generation_pb2 as pb
from pagedserve_client import AsyncClient


@dataclass
class RequestRecord:
    """One request's timings (seconds since the run started) and server-reported usage."""

    index: int
    max_tokens: int
    sent_at: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each message carrying tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in that message
    finished_at: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_prompt_tokens: int = 0
    finish_reason: str = ""
    error: str = ""

    @property
    def ttft(self) -> float:
        assert self.chunk_times, f"request {self.index} produced no tokens"
        return self.chunk_times[0] - self.sent_at

    @property
    def e2e(self) -> float:
        return self.finished_at - self.sent_at

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for one-token outputs."""
        if self.output_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between successive messages (a message may carry several tokens)."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration_s: float  # first send to last finish

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.records)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.records)


async def _one(
    client: AsyncClient,
    index: int,
    req: BenchRequest,
    at: float,
    t0: float,
    on_done: Callable[[RequestRecord], None] | None,
    id_prefix: str,
) -> RequestRecord:
    delay = t0 + at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    rec = RequestRecord(index=index, max_tokens=req.max_tokens, sent_at=time.perf_counter() - t0)
    try:
        async for msg in client.generate(
            token_ids=req.prompt_token_ids,
            max_tokens=req.max_tokens,
            ignore_eos=True,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            request_id=f"{id_prefix}-{index}",
        ):
            now = time.perf_counter() - t0
            if msg.token_ids:
                rec.chunk_times.append(now)
                rec.chunk_tokens.append(len(msg.token_ids))
            if msg.finish_reason:
                rec.finished_at = now
                rec.finish_reason = msg.finish_reason
                rec.prompt_tokens = msg.usage.prompt_tokens
                rec.output_tokens = msg.usage.completion_tokens
                rec.cached_prompt_tokens = msg.usage.cached_prompt_tokens
    except grpc.RpcError as e:
        rec.error = f"{e.code().name}: {e.details()}"
        rec.finished_at = time.perf_counter() - t0
    if on_done is not None:
        on_done(rec)
    return rec


async def run_requests_async(
    target: str,
    requests: list[BenchRequest],
    arrivals: list[float] | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
    during: Callable[[AsyncClient], object] | None = None,
    id_prefix: str | None = None,
) -> RunResult:
    """Sends every request (at arrivals[i] seconds, default all at once) and waits for all.

    `during(client)`, if given, is a coroutine function run alongside the
    requests and cancelled when they are done (the memory suite samples
    server status with it). Request i is sent with id f"{id_prefix}-{i}"
    (default prefix: random, so runs sharing a server never collide).
    Raises RuntimeError naming the first failure if any request failed or
    stopped short of its max_tokens; re-raises what `during` raised.
    """
    if any(r.prompt_token_ids is None for r in requests):
        raise ValueError("tokenize text prompts before running (workloads.tokenize_text_prompts)")
    arrivals = arrivals if arrivals is not None else [0.0] * len(requests)
    id_prefix = id_prefix or f"bench-{uuid.uuid4().hex[:8]}"
    assert len(arrivals) == len(requests), "one arrival time per request"
    async with AsyncClient(target) as client:
        side = asyncio.ensure_future(during(client)) if during is not None else None
        t0 = time.perf_counter()
        records = await asyncio.gather(
            *(_one(client, i, r, at, t0, on_done, id_prefix) for i, (r, at) in enumerate(zip(requests, arrivals)))
        )
        if side is not None:
            side.cancel()
            (outcome,) = await asyncio.gather(side, return_exceptions=True)
            if isinstance(outcome, Exception):  # a failed sampler; cancellation is a BaseException
                raise outcome
    _check(records)
    start = min(r.sent_at for r in records)
    return RunResult(records=list(records), duration_s=max(r.finished_at for r in records) - start)


def _check(records: list[RequestRecord]) -> None:
    failed = [r for r in records if r.error]
    if failed:
        raise RuntimeError(
            f"{len(failed)} of {len(records)} requests failed; first: request {failed[0].index}: {failed[0].error}"
        )
    short = [r for r in records if r.output_tokens != r.max_tokens]
    if short:
        r = short[0]
        raise RuntimeError(
            f"{len(short)} requests did not produce exactly max_tokens (ignore_eos is set); "
            f"first: request {r.index} produced {r.output_tokens} of {r.max_tokens} "
            f"(finish {r.finish_reason})"
        )


def run_requests(
    target: str,
    requests: list[BenchRequest],
    arrivals: list[float] | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
    during: Callable[[AsyncClient], object] | None = None,
    id_prefix: str | None = None,
) -> RunResult:
    return asyncio.run(run_requests_async(target, requests, arrivals, on_done, during, id_prefix))


def percentile(values: list[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default), p in [0, 100]; nan for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def model_info(target: str) -> dict:
    """The served model and limits (GetModelInfo), as a plain dict for the result file."""
    from google.protobuf.json_format import MessageToDict

    async def get():
        async with AsyncClient(target) as c:
            return await c.model_info()

    return MessageToDict(asyncio.run(get()), preserving_proto_field_name=True)


def engine_workload(args, target: str) -> tuple[dict, list[BenchRequest]]:
    """The served model's facts and the workload `args` describe (text prompts
    tokenized by the engine), checked to fit its context and vocabulary."""
    from bench.workloads import check_fits, workload_from_args
    from pagedserve_client import Client

    info = model_info(target)
    with Client(target) as c:
        requests = workload_from_args(args, int(info["vocab_size"]), c.tokenize)
    check_fits(requests, int(info["max_model_len_tokens"]), int(info["vocab_size"]))
    return info, requests


def server_status(target: str) -> pb.ServerStatus:
    async def get():
        async with AsyncClient(target) as c:
            return await c.server_status()

    return asyncio.run(get())


def warm_up(target: str, vocab_size: int) -> None:
    """Two short requests before any timing, so one-time costs (first forward, lazy imports) are not measured."""
    from bench.workloads import uniform_workload

    run_requests(target, uniform_workload(2, (32, 48), (4, 4), vocab_size, seed=12345))
