"""Bad input gets a clear error and changes nothing.

End to end, through the real processes: a few invalid requests are answered
with the right status code and a BadRequest field violation naming the field
(the full table of rules is unit-tested in test_validation.py), limits that
only the server holds (message size, live request ids, the waiting queue)
answer with theirs, and afterwards a normal request still succeeds and no KV
block is held.
"""

from __future__ import annotations

import math
import threading

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from pagedserve.v1 import generation_pb2 as pb
from pagedserve_client import Client, build_request
from tests.servers import Servers

pytestmark = pytest.mark.e2e
INVALID, OUT_OF_RANGE = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE


def chat(messages) -> pb.GenerateRequest:
    req = pb.GenerateRequest()
    req.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in messages)
    return req


def with_sampling(**kw) -> pb.GenerateRequest:
    return build_request("Hello", **kw)


# Every validation rule is unit-tested in test_validation.py; these few cases
# check, through the real processes, that each kind of rejection (no prompt,
# a sampling value, a chat message, the served model's vocabulary and context)
# reaches the client with its status code and a BadRequest field violation.
CASES = [
    ("no prompt", pb.GenerateRequest(), INVALID, "prompt"),
    ("token id outside vocab", build_request(token_ids=[1, 2, 49152]), INVALID, "prompt.token_ids.ids"),
    ("NaN temperature", with_sampling(temperature=math.nan), INVALID, "sampling.temperature"),
    ("unknown chat role", chat([("user", "hi"), ("wizard", "abracadabra")]), INVALID, "prompt.chat.messages[1].role"),
    (
        "prompt + max_tokens beyond context",
        build_request(token_ids=[100] * 8000, max_tokens=500),
        OUT_OF_RANGE,
        "stopping.max_tokens",
    ),
]


@pytest.fixture(scope="module")
def servers():
    with Servers(
        executor_args=["--dtype", "float32", "--kv-cache-gib", "1"],
        scheduler_args=["--max-message-bytes", "65536", "--max-waiting", "4", "--max-num-seqs", "2"],
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(servers):
    with Client(servers.public_addr) as c:
        yield c


def call(client: Client, req: pb.GenerateRequest):
    return list(client._stub.Generate(req, timeout=60))


@pytest.mark.parametrize("name,req,code,field", CASES, ids=[c[0] for c in CASES])
def test_invalid_request_is_rejected_with_field(client, name, req, code, field):
    with pytest.raises(grpc.RpcError) as info:
        call(client, req)
    err = info.value
    assert err.code() == code, err.details()
    status = rpc_status.from_call(err)
    assert status is not None, "rich status details missing"
    violation = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(violation)
    assert violation.field_violations[0].field == field
    assert violation.field_violations[0].description


def test_oversized_message_gets_resource_exhausted(client):
    with pytest.raises(grpc.RpcError) as info:
        call(client, build_request("x " * 40000))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_duplicate_live_request_id_gets_already_exists(client):
    stream = client.generate(
        "Tell me a long story about a dragon.", request_id="dup-1", max_tokens=200, ignore_eos=True
    )
    first = next(stream)
    assert first.request_id == "dup-1"
    with pytest.raises(grpc.RpcError) as info:
        call(client, build_request("Hi", request_id="dup-1"))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    stream.cancel()


def test_full_waiting_queue_gets_resource_exhausted(client):
    # --max-num-seqs 2 and --max-waiting 4: eight long requests cannot all be queued.
    codes, lock = [], threading.Lock()

    def one(i):
        try:
            client.complete(f"Request {i}:", max_tokens=64, ignore_eos=True, timeout=120)
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
        with lock:
            codes.append(code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    assert grpc.StatusCode.OK in codes
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}


def test_server_still_serves_and_holds_no_blocks_afterwards(client):
    out = client.complete("The capital of France is", max_tokens=5, temperature=0.0)[0]
    assert out.completion_tokens == 5 or out.finish_reason == "stop"
    status = client.server_status()
    assert status.kv_blocks_used == 0 and status.num_running == 0 and status.num_waiting == 0


def test_cli_reports_values_a_request_cannot_carry_without_a_traceback():
    import subprocess
    import sys

    cli = [sys.executable, "-m", "pagedserve_client.cli", "--target", "127.0.0.1:1", "generate", "Hi"]
    for flag, value in (("--max-tokens", "-3"), ("--seed", "-1"), ("--top-k", "99999999999")):
        out = subprocess.run([*cli, flag, value], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and out.stderr.startswith("error: ") and "Traceback" not in out.stderr, out.stderr


def test_the_client_raises_typed_errors_naming_the_field(client):
    from pagedserve_client import BadRequestError, ConflictError

    with pytest.raises(BadRequestError) as info:
        client.complete("Hello", temperature=-0.5, timeout=60)
    assert info.value.code() == INVALID and info.value.field_violations[0].field == "sampling.temperature"
    with pytest.raises(BadRequestError) as info:
        client.complete(token_ids=[100] * 8300, timeout=60)
    assert info.value.code() == OUT_OF_RANGE and info.value.field_violations[0].field == "prompt.token_ids"
    with pytest.raises(BadRequestError) as info:
        client.detokenize([10**6])
    assert info.value.field_violations[0].field == "token_ids"
    with client.generate("Tell me a long story.", request_id="dup-typed", max_tokens=200, ignore_eos=True) as stream:
        next(stream)
        with pytest.raises(ConflictError):
            client.complete("Hi", request_id="dup-typed", timeout=60)
