"""pagedserve_client without a server: requests it builds, results it returns, errors it raises."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from pagedserve.v1 import generation_pb2 as pb
from pagedserve_client import (
    BadRequestError,
    Client,
    Completion,
    FieldViolation,
    PagedServeError,
    UnavailableError,
    Usage,
    build_request,
)
from pagedserve_client.errors import from_rpc_error
from tests.servers import REPO, free_port


@pytest.mark.parametrize("stop, expected", [("END", ["END"]), (["a", "bc"], ["a", "bc"]), (None, []), ((), [])])
def test_stop_is_a_string_or_a_list(stop, expected):
    assert list(build_request("Hi", stop=stop).stopping.stop) == expected


def test_one_result_type_for_deltas_and_whole_samples():
    mid = Completion.from_proto(pb.GenerateResponse(request_id="r", index=1, token_ids=[5, 6], text="ab"))
    assert (mid.finish_reason, mid.usage, mid.text) == (None, None, "ab")
    last = pb.GenerateResponse(
        request_id="r",
        index=1,
        token_ids=[7],
        text="c",
        finish_reason=pb.FINISH_REASON_STOP,
        usage=pb.Usage(prompt_tokens=3, completion_tokens=3, cached_prompt_tokens=2),
        matched_stop="d",
        matched_stop_token_id=9,
    )
    last.logprobs.add(token_id=7, logprob=-0.5, top=[pb.TopLogprob(token_id=7, logprob=-0.5)])
    end = Completion.from_proto(last)
    assert end.finish_reason == "stop" and end.usage == Usage(3, 3, 2) and end.matched_stop_token_id == 9
    whole = Completion()
    whole.add(mid)
    whole.add(end)
    assert (whole.index, whole.text, whole.token_ids, whole.finish_reason) == (1, "abc", [5, 6, 7], "stop")
    assert (whole.prompt_tokens, whole.completion_tokens, whole.cached_prompt_tokens) == (3, 3, 2)
    assert whole.logprobs[0].top[0].token_id == 7 and whole.matched_stop == "d"


class _FakeCall(grpc.RpcError):
    """What grpc raises: a call with a code, details and trailing metadata (the rich status)."""

    def __init__(self, code, details, trailing=()):
        self._code, self._details, self._trailing = code, details, trailing

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing


def test_errors_carry_the_code_and_field_violations():
    bad = error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field="sampling.temperature", description="must be >= 0")
        ]
    )
    status = status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message="sampling.temperature: must be >= 0")
    status.details.add().Pack(bad)
    err = from_rpc_error(
        _FakeCall(grpc.StatusCode.INVALID_ARGUMENT, status.message, rpc_status.to_status(status).trailing_metadata)
    )
    assert isinstance(err, BadRequestError) and isinstance(err, grpc.RpcError)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details() == status.message
    assert err.field_violations == (FieldViolation("sampling.temperature", "must be >= 0"),)
    plain = from_rpc_error(_FakeCall(grpc.StatusCode.INTERNAL, "boom"))
    assert type(plain) is PagedServeError and plain.field_violations == () and "INTERNAL" in repr(plain)


def test_an_unreachable_server_raises_a_typed_error():
    with Client(f"127.0.0.1:{free_port()}") as c:
        with pytest.raises(UnavailableError):
            c.complete("Hi", max_tokens=2, timeout=5)
        with pytest.raises(UnavailableError):
            c.tokenize("Hi")


def test_version_and_no_torch_for_the_client():
    out = subprocess.run(
        [sys.executable, "-m", "pagedserve_client.cli", "--version"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    from importlib.metadata import version

    assert out.returncode == 0 and out.stdout.strip() == f"pagedserve {version('pagedserve')}"
    probe = "import sys, pagedserve_client, pagedserve_client.cli; print('torch' in sys.modules)"
    assert (
        subprocess.run(
            [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60
        ).stdout.strip()
        == "False"
    )
