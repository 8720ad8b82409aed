"""Sidecar deployment: the public API on a Unix socket, connections recycled
by --max-connection-age, and SIGTERM draining in-flight streams.

What gRPC guarantees, and so what is tested: after the age limit the server
sends GOAWAY; a stream already running on that connection keeps going (for up
to the grace period, here --drain-timeout), and new calls go over a fresh
connection without the caller noticing.
"""

from __future__ import annotations

import os
import signal
import stat
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pagedserve_client import Client
from tests.servers import Servers, health_status

pytestmark = pytest.mark.e2e
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
MAX_AGE_S = 1.0


@pytest.fixture(scope="module")
def servers():
    s = Servers(
        executor_args=["--dtype", "float32", "--kv-cache-gib", "0.25"],
        scheduler_args=["--max-connection-age", str(MAX_AGE_S), "--drain-timeout", "30"],
    )
    s.public_addr = f"unix://{s.tmp}/public.sock"
    with s:
        yield s


@pytest.fixture
def client(servers):
    with Client(servers.public_addr) as c:
        yield c


def collect(client: Client, out: dict, key: str, prompt: str, max_tokens: int) -> None:
    """Runs one stream to its end; stores its messages, or the RpcError that ended it."""
    try:
        out[key] = list(client.generate(prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.0, timeout=120))
    except grpc.RpcError as e:
        out[key] = e


def assert_complete(msgs, max_tokens: int) -> None:
    assert isinstance(msgs, list), f"stream failed: {msgs!r}"
    assert msgs[-1].finish_reason == "length"
    assert msgs[-1].usage.completion_tokens == sum(len(m.token_ids) for m in msgs) == max_tokens


def test_generate_and_health_over_the_unix_socket(servers, client):
    path = servers.public_addr.removeprefix("unix://")
    assert stat.S_ISSOCK(os.stat(path).st_mode)
    assert health_status(servers.public_addr) == SERVING
    assert health_status(servers.public_addr, "pagedserve.v1.Generation") == SERVING
    out = client.complete("The capital of France is", max_tokens=4, temperature=0.0)[0]
    assert out.token_ids and out.finish_reason in ("length", "stop")
    assert client.model_info().vocab_size > 0


def test_aged_connections_are_replaced_while_streams_and_new_calls_succeed(client):
    states: list[grpc.ChannelConnectivity] = []
    record = states.append
    client._channel.subscribe(record, try_to_connect=True)
    try:
        streams: dict = {}
        # ~4 s of decoding on a connection that is told to go away after ~1 s.
        long = threading.Thread(target=collect, args=(client, streams, "long", "Tell me a long story.", 32))
        long.start()
        calls, end = 0, time.monotonic() + 4 * MAX_AGE_S
        while time.monotonic() < end:
            assert client.tokenize("hello"), "a unary call after the age limit failed"
            calls += 1
            time.sleep(0.1)
        long.join(timeout=120)
        assert_complete(streams["long"], 32)
    finally:
        client._channel.unsubscribe(record)
    ready = grpc.ChannelConnectivity.READY
    first = states.index(ready)
    reconnects = sum(1 for a, b in zip(states[first:], states[first + 1 :]) if a != ready and b == ready)
    assert reconnects >= 2, f"the connection was not recycled every {MAX_AGE_S}s: {[s.name for s in states]}"
    assert calls >= 10


def test_sigterm_drains_in_flight_streams_then_exits_zero(servers, client):
    # Last in this module: the scheduler is gone afterwards.
    streams: dict = {}
    threads = [threading.Thread(target=collect, args=(client, streams, i, f"Item {i}: a story", 24)) for i in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while client.server_status().num_running < 3:
        assert time.monotonic() < deadline, "the three streams never ran together"
        time.sleep(0.01)
    servers.scheduler.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    while health_status(servers.public_addr) != NOT_SERVING:
        assert time.monotonic() < deadline, "health did not turn NOT_SERVING on SIGTERM"
        time.sleep(0.02)
    with pytest.raises(grpc.RpcError) as info:
        client.complete("too late", max_tokens=2, timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    for t in threads:
        t.join(timeout=120)
    for i in range(3):
        assert_complete(streams[i], 24)
    assert servers.scheduler.wait(timeout=30) == 0
    assert health_status(servers.public_addr) is None, "the socket still answers after exit"
