"""256 concurrent streaming clients: nothing hangs, nothing leaks.

Two identical waves of 256 streams over four channels: mixed prompt lengths
(5-200 tokens, many sharing a prefix), 1-16 output tokens, a fifth of the
clients cancelling at a random point (after some tokens, or after some time,
possibly while still queued) and some with deadlines shorter than their work.
Every stream that is neither cancelled nor past its deadline must end with a
finish reason and usage that matches what it received; after each wave the
engine holds no KV block and no request, and the scheduler's memory after the
second wave is within a bound of what it was after the first (warm-up) wave.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import random
import textwrap
import threading
import time
from dataclasses import dataclass

import grpc
import pytest

from pagedserve.v1 import generation_pb2 as pb
from pagedserve_client import AsyncClient, Client, Completion
from tests.servers import Servers

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
NUM_CLIENTS = 256
NUM_CHANNELS = 4
WAVE_TIMEOUT_S = 240  # a hung stream fails the test instead of stalling it
RSS_GROWTH_LIMIT_MB = 50
LENGTH, STOP = "length", "stop"


@dataclass(frozen=True)
class Spec:
    prompt: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool
    seed: int
    cancel_after_tokens: int | None = None  # stop reading (and cancel) after this many tokens
    cancel_after_s: float | None = None  # cancel after this long, whatever has arrived
    deadline_s: float | None = None  # a gRPC deadline that may pass before the work is done

    @property
    def must_finish(self) -> bool:
        return self.cancel_after_tokens is None and self.cancel_after_s is None and self.deadline_s is None


@dataclass
class Outcome:
    spec: Spec
    kind: str  # "finished", "cancelled", or a grpc status code name
    tokens: int = 0
    last: Completion | None = None


def make_specs(text_ids: list[int], rng: random.Random) -> list[Spec]:
    specs = []
    for i in range(NUM_CLIENTS):
        shared = rng.choice([0, 0, 64, 128, 160])  # a few common prefixes, as system prompts give
        unique = rng.randint(5, 40)
        start = rng.randrange(200, len(text_ids) - unique)
        prompt = tuple(text_ids[:shared] + text_ids[start : start + unique])
        max_tokens = rng.randint(1, 16)
        kw = {}
        roll = rng.random()
        if roll < 0.10 and max_tokens > 1:
            kw["cancel_after_tokens"] = rng.randint(1, max_tokens - 1)
        elif roll < 0.20:
            kw["cancel_after_s"] = rng.uniform(0.0, 3.0)
        elif roll < 0.30:
            kw["deadline_s"] = rng.uniform(0.2, 2.0)
        specs.append(Spec(prompt, max_tokens, ignore_eos=rng.random() < 0.5, seed=i, **kw))
    return specs


async def run_one(client: AsyncClient, spec: Spec) -> Outcome:
    out = Outcome(spec, "finished")

    async def consume():
        async for msg in client.generate(
            token_ids=list(spec.prompt),
            max_tokens=spec.max_tokens,
            ignore_eos=spec.ignore_eos,
            temperature=0.8,
            seed=spec.seed,
            timeout=spec.deadline_s or WAVE_TIMEOUT_S,
        ):
            out.tokens += len(msg.token_ids)
            if msg.finish_reason:
                out.last = msg
            if spec.cancel_after_tokens is not None and out.tokens >= spec.cancel_after_tokens:
                out.kind = "cancelled"
                return  # leaving the loop cancels the call

    task = asyncio.ensure_future(consume())
    try:
        if spec.cancel_after_s is not None:
            done, _ = await asyncio.wait([task], timeout=spec.cancel_after_s)
            if not done:
                task.cancel()
                out.kind = "cancelled"
        await task
    except asyncio.CancelledError:
        if out.kind != "cancelled":
            raise
    except grpc.RpcError as e:
        out.kind = e.code().name
    return out


async def wave(clients: list[AsyncClient], specs: list[Spec]) -> list[Outcome]:
    runs = [run_one(clients[i % len(clients)], s) for i, s in enumerate(specs)]
    return await asyncio.wait_for(asyncio.gather(*runs), WAVE_TIMEOUT_S)


def check_outcomes(outcomes: list[Outcome]) -> collections.Counter:
    kinds = collections.Counter(o.kind for o in outcomes)
    for o in outcomes:
        s = o.spec
        if s.must_finish:
            assert o.kind == "finished", f"an ordinary stream ended with {o.kind}: {s}"
        elif s.deadline_s is not None:
            assert o.kind in ("finished", "DEADLINE_EXCEEDED"), f"a stream with a deadline ended with {o.kind}: {s}"
        else:
            assert o.kind in ("finished", "cancelled"), f"a cancelling stream ended with {o.kind}: {s}"
        if o.kind != "finished":
            continue
        assert o.last is not None, f"stream ended without a finish reason: {s}"
        assert o.last.usage.completion_tokens == o.tokens, (
            f"usage says {o.last.usage.completion_tokens}, got {o.tokens}"
        )
        assert o.last.usage.prompt_tokens == len(s.prompt)
        assert o.last.finish_reason in (LENGTH, STOP)
        if o.last.finish_reason == LENGTH or s.ignore_eos:
            assert o.last.finish_reason == LENGTH and o.tokens == s.max_tokens, s
        else:
            assert 1 <= o.tokens <= s.max_tokens
    assert kinds["cancelled"] >= NUM_CLIENTS // 10, f"too few cancellations to test anything: {kinds}"
    return kinds


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


async def wait_idle(client: AsyncClient, timeout: float = 10.0) -> pb.ServerStatus:
    deadline = time.monotonic() + timeout
    while True:
        s = await client.server_status()
        if s.kv_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0:
            return s
        assert time.monotonic() < deadline, f"engine not idle {timeout}s after the wave: {s}"
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def servers():
    with Servers(
        executor_args=["--dtype", "float32", "--kv-cache-gib", "0.5"], scheduler_args=["--max-num-seqs", "256"]
    ) as s:
        yield s


def test_256_concurrent_streams_with_cancels_and_deadlines_leave_no_trace(servers):
    text = " ".join(
        " ".join(m.__doc__.split()) for m in (json, logging, argparse, textwrap, threading, collections, random)
    )
    with Client(servers.public_addr) as c:
        text_ids = c.tokenize(text, add_special_tokens=False)
    assert len(text_ids) > 600
    specs = make_specs(text_ids, random.Random(1234))

    async def main():
        clients = [AsyncClient(servers.public_addr) for _ in range(NUM_CHANNELS)]
        try:
            report = []
            for name in ("warm-up", "measured"):
                start = time.monotonic()
                kinds = check_outcomes(await wave(clients, specs))
                await wait_idle(clients[0])
                report.append(
                    (name, round(time.monotonic() - start, 1), dict(kinds), round(rss_mb(servers.scheduler.pid), 1))
                )
            return report
        finally:
            for c in clients:
                await c.close()

    (_, _, _, rss_warm), (_, _, _, rss_end) = report = asyncio.run(main())
    print("waves (name, seconds, outcomes, scheduler RSS MB):", report)
    assert rss_end - rss_warm < RSS_GROWTH_LIMIT_MB, (
        f"scheduler RSS grew {rss_end - rss_warm:.1f} MB over an identical wave"
    )
