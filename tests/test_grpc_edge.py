"""The public edge fails closed: bearer-token parsing, unknown methods, corrupt
messages, token files that would weaken authentication.

A stand-in Generation servicer runs in process behind the real interceptors,
in the order scheduler_svc/__main__.py installs them.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from scheduler_svc.config import parse_config
from shared.grpc_auth import BearerAuthInterceptor, TokenTable
from shared.grpc_codec import CodecInterceptor

TOKEN, ADMIN = "user-token-4f2a", "admin-token-9e1c"
TOKENIZE, GENERATE = "/pagedserve.v1.Generation/Tokenize", "/pagedserve.v1.Generation/Generate"
BAD_UTF8 = b"\x0a\x02\xff\xfe"  # field 1 (text), 2 bytes that are not UTF-8
CORRUPT = b"\xff\xff\xff"
C = grpc.StatusCode


class Echo(pb_grpc.GenerationServicer):
    async def Tokenize(self, request, context):
        if request.text == "pre-serialized":  # two serialized parts: their concatenation is their merge
            return (
                pb.TokenizeResponse(token_ids=[1]).SerializeToString()
                + pb.TokenizeResponse(token_ids=[2]).SerializeToString()
            )
        if request.text == "bug":
            raise RecursionError("a handler's own failure")
        if request.text == "refuse":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "refused on purpose")
        return pb.TokenizeResponse(token_ids=[len(request.text)])

    async def Generate(self, request, context):
        yield pb.GenerateResponse(request_id=request.request_id)
        if request.request_id == "bug":  # fails after a first response
            raise KeyError("a handler's own failure")


async def call(
    method: str, raw: bytes, metadata=(), stream: bool = False, answers: list | None = None
) -> grpc.StatusCode:
    server = grpc.aio.server(
        interceptors=[BearerAuthInterceptor(TokenTable((TOKEN, ADMIN), (ADMIN,))), CodecInterceptor()]
    )
    pb_grpc.add_GenerationServicer_to_server(Echo(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                if stream:
                    [_ async for _ in channel.unary_stream(method)(raw, metadata=metadata, timeout=10)]
                else:
                    answer = await channel.unary_unary(method)(raw, metadata=metadata, timeout=10)
                    if answers is not None:
                        answers.append(answer)
                return C.OK
            except grpc.aio.AioRpcError as e:
                return e.code()
    finally:
        await server.stop(None)


def code(method: str, raw: bytes = b"", metadata=(), stream: bool = False) -> grpc.StatusCode:
    return asyncio.run(call(method, raw, tuple(metadata), stream))


def bearer(value: str) -> tuple:
    return (("authorization", value),)


@pytest.mark.parametrize("header", [f"Bearer {TOKEN}", f"bearer {TOKEN}", f"BEARER {ADMIN}", f"Bearer   {TOKEN}"])
def test_bearer_scheme_is_case_insensitive(header):
    assert code(TOKENIZE, metadata=bearer(header)) == C.OK


@pytest.mark.parametrize(
    "header", [f"Bearer {TOKEN.upper()}", f"Basic {TOKEN}", TOKEN, f"Bearer{TOKEN}", "Bearer ", ""]
)
def test_wrong_tokens_and_schemes_are_refused(header):
    assert code(TOKENIZE, metadata=bearer(header)) == C.UNAUTHENTICATED


@pytest.mark.parametrize("second", [f"Bearer {TOKEN}", f"Bearer {ADMIN}", "Bearer wrong"])
def test_two_authorization_headers_are_refused(second):
    assert code(TOKENIZE, metadata=bearer(f"Bearer {TOKEN}") + bearer(second)) == C.UNAUTHENTICATED


def test_unknown_methods_are_authenticated_first():
    assert code("/pagedserve.v1.Generation/Nope") == C.UNAUTHENTICATED
    assert code("/no.such.Service/Call", metadata=bearer("Bearer wrong")) == C.UNAUTHENTICATED
    assert code("/pagedserve.v1.Generation/Nope", metadata=bearer(f"Bearer {TOKEN}")) == C.UNIMPLEMENTED


def test_health_stays_open():
    assert code("/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest().SerializeToString()) == C.OK


@pytest.mark.parametrize("raw", [BAD_UTF8, CORRUPT])
@pytest.mark.parametrize("method,stream", [(TOKENIZE, False), (GENERATE, True)])
def test_corrupt_messages_are_invalid_argument(method, stream, raw):
    assert code(method, raw, bearer(f"Bearer {TOKEN}"), stream) == C.INVALID_ARGUMENT
    assert code(method, raw, stream=stream) == C.UNAUTHENTICATED  # an unauthenticated message is never parsed


@pytest.mark.parametrize(
    "method,raw,stream",
    [
        (TOKENIZE, pb.TokenizeRequest(text="bug").SerializeToString(), False),
        (GENERATE, pb.GenerateRequest(request_id="bug").SerializeToString(), True),
    ],
)
def test_a_handlers_unexpected_failure_is_internal_and_logged(method, raw, stream):
    """Not UNKNOWN: one place answers INTERNAL for what a handler let through,
    and logs it; a handler's own abort keeps its status."""
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        assert code(method, raw, bearer(f"Bearer {TOKEN}"), stream) == C.INTERNAL
    assert [e["method"] for e in logs if e["event"] == "handler_failed"] == [method]
    refuse = pb.TokenizeRequest(text="refuse").SerializeToString()
    assert code(TOKENIZE, refuse, bearer(f"Bearer {TOKEN}")) == C.FAILED_PRECONDITION


def test_a_handler_may_answer_with_serialized_bytes():
    answers = []
    req = pb.TokenizeRequest(text="pre-serialized").SerializeToString()
    assert asyncio.run(call(TOKENIZE, req, bearer(f"Bearer {TOKEN}"), answers=answers)) == C.OK
    assert list(pb.TokenizeResponse.FromString(answers[0]).token_ids) == [1, 2]


def test_token_table_names_callers_without_revealing_tokens():
    table = TokenTable((TOKEN, ADMIN), (ADMIN,))
    user, admin = table.identify(bearer(f"Bearer {TOKEN}")), table.identify(bearer(f"bearer {ADMIN}"))
    assert not user.admin and admin.admin and user.name != admin.name
    assert TOKEN not in user.name and ADMIN not in admin.name
    assert table.identify(()) is None
    with pytest.raises(ValueError):
        TokenTable(())


# ---- token files: fail closed, one line naming the file ------------------------------------


@pytest.mark.parametrize("content", ["", "\n\n", "# only a comment\n"])
@pytest.mark.parametrize("flag", ["--auth-tokens-file", "--executor-auth-token-file"])
def test_empty_token_files_refuse_to_start(tmp_path, capsys, flag, content):
    path = tmp_path / "tokens"
    path.write_text(content)
    with pytest.raises(SystemExit) as info:
        parse_config([flag, str(path)], environ={})
    assert info.value.code != 0
    err = capsys.readouterr().err
    assert str(path) in err and flag in err and err.count("\n") == 1 and "Traceback" not in err


def test_unreadable_token_file_refuses_to_start(tmp_path, capsys):
    path = tmp_path / "missing"
    with pytest.raises(SystemExit) as info:
        parse_config(["--auth-tokens-file", str(path)], environ={})
    assert info.value.code != 0
    err = capsys.readouterr().err
    assert str(path) in err and err.count("\n") == 1


def test_tokens_file_marks_admins_and_keeps_plain_lines(tmp_path, capsys):
    path = tmp_path / "tokens"
    path.write_text(f"# callers\n{TOKEN}\n\n  {ADMIN}   admin \n")
    config = parse_config(["--auth-tokens-file", str(path)], environ={})
    assert config.auth_tokens == (TOKEN, ADMIN) and config.admin_tokens == (ADMIN,)
    path.write_text(f"{TOKEN} root\n")
    with pytest.raises(SystemExit):
        parse_config(["--auth-tokens-file", str(path)], environ={})
    err = capsys.readouterr().err
    assert "line 1" in err and TOKEN not in err  # names the line, never echoes the token
