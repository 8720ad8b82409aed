"""Nothing heavy runs on the scheduler's event loop (issue 19).

Three maximal (~4 MB) requests are tokenized, rendered and detokenized while a
stream runs and the health service is probed every 200 ms with a 1 s timeout:
every probe must answer and the stream must keep its pace. Before the fix one
such request held the loop for seconds (the text alone ~3.5 s on the dev box).
"""

from __future__ import annotations

import itertools
import random
import statistics
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.v1 import generation_pb2 as pb
from pagedserve_client import Client
from tests.servers import Servers

pytestmark = pytest.mark.e2e
MESSAGE_BYTES = 4 << 20  # the scheduler's default --max-message-bytes


def big_requests(words: list[str]) -> list[tuple[str, object]]:
    rng = random.Random(0)
    text = []
    size = 0
    while size < MESSAGE_BYTES - 200_000:
        word = rng.choice(words)
        text.append(word)
        size += len(word) + 1
    text = " ".join(text)
    chat = pb.Chat(
        messages=[pb.ChatMessage(role=("user", "assistant")[i % 2], content=rng.choice(words)) for i in range(200_000)]
    )
    ids = [rng.randrange(100, 40_000) for _ in range(1_200_000)]
    return [
        ("Tokenize", pb.TokenizeRequest(text=text)),
        ("Tokenize", pb.TokenizeRequest(chat=chat)),
        ("Detokenize", pb.DetokenizeRequest(token_ids=ids)),
    ]


def test_health_and_streams_keep_going_while_large_requests_are_tokenized(english_prompts):
    words = " ".join(english_prompts).split()
    requests = big_requests(words)
    assert all(len(r.SerializeToString()) < MESSAGE_BYTES for _, r in requests)
    with Servers(executor_args=["--dtype", "float32", "--kv-cache-gib", "0.2"]) as s, Client(s.public_addr) as c:
        channel = grpc.insecure_channel(s.public_addr, options=[("grpc.max_receive_message_length", 64 << 20)])
        probe_channel = grpc.insecure_channel(s.public_addr)  # an orchestrator's probes come on their own connection
        health = health_pb2_grpc.HealthStub(probe_channel)
        stream = c.generate("Once upon a time", max_tokens=3000, ignore_eos=True, timeout=600)
        arrivals: list[float] = []

        def read() -> None:
            try:
                for _ in stream:
                    arrivals.append(time.monotonic())
            except grpc.RpcError:
                pass  # cancelled by stream.close() below

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        while len(arrivals) < 20:  # the stream's pace before
            time.sleep(0.05)
        before = statistics.median(b - a for a, b in itertools.pairwise(arrivals))
        # Sent and answered as raw bytes: parsing millions of elements here would hold
        # this process's GIL and delay the probes on the client side.
        results, probes = {}, []
        raw = [(channel.unary_unary(f"/pagedserve.v1.Generation/{m}"), r.SerializeToString()) for m, r in requests]
        heavy = [
            threading.Thread(target=lambda i=i, call=call, body=body: results.__setitem__(i, call(body, timeout=300)))
            for i, (call, body) in enumerate(raw)
        ]
        started = time.monotonic()
        for t in heavy:
            t.start()
        while any(t.is_alive() for t in heavy):
            t0 = time.monotonic()
            try:
                health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                probes.append(time.monotonic() - t0)
            except grpc.RpcError as e:
                probes.append(e.code())
            time.sleep(max(0.0, 0.2 - (time.monotonic() - t0)))
        elapsed = time.monotonic() - started
        during = [b - a for a, b in itertools.pairwise(arrivals) if a >= started]
        stream.close()
        channel.close()
        probe_channel.close()
        assert len(results) == 3, "a large request failed"
        assert (
            pb.TokenizeResponse.FromString(results[0]).token_ids
            and pb.TokenizeResponse.FromString(results[1]).token_ids
        )
        assert pb.DetokenizeResponse.FromString(results[2]).text
        failed = [p for p in probes if not isinstance(p, float)]
        print(
            f"{elapsed=:.1f}s probes={len(probes)} slowest probe={max(p for p in probes if isinstance(p, float)):.3f}s "
            f"stream gap before={before * 1000:.0f}ms during max={max(during) * 1000:.0f}ms median={statistics.median(during) * 1000:.0f}ms"
        )
        assert not failed, f"{len(failed)} of {len(probes)} health probes failed within 1 s over {elapsed:.1f} s"
        # Old code: the text alone held the loop >3 s here. What remains on the shared
        # 2-core box is CPU contention (the tokenizer threads and the executor share
        # two cores) and short GIL-holding steps (~0.1-0.4 s).
        assert during and max(during) < 1.5 and statistics.median(during) < 4 * before + 0.05, (max(during), before)
