"""Typed errors for failed calls, instead of grpc's raw call objects.

Every error is a `PagedServeError`, itself a `grpc.RpcError`, so code that
catches `grpc.RpcError` and calls `.code()` / `.details()` keeps working. A
bad request also says which fields were wrong, from the google.rpc.BadRequest
details the scheduler attaches:

    try:
        client.complete("Hi", temperature=-1)
    except BadRequestError as e:
        e.code()                # grpc.StatusCode.INVALID_ARGUMENT
        e.field_violations      # (FieldViolation(field='sampling.temperature', description='...'),)
"""

from __future__ import annotations

from typing import NamedTuple

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status


class FieldViolation(NamedTuple):
    field: str  # the request field's path, e.g. "sampling.temperature"
    description: str


class PagedServeError(grpc.RpcError):
    """A call that failed: its gRPC status code, message and field violations (if any)."""

    def __init__(self, code: grpc.StatusCode, details: str, field_violations: tuple[FieldViolation, ...] = ()):
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details
        self.field_violations = tuple(field_violations)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._code.name}, {self._details!r}, field_violations={list(self.field_violations)})"


class BadRequestError(PagedServeError):
    """INVALID_ARGUMENT, OUT_OF_RANGE (prompt too long) or FAILED_PRECONDITION: fix the request."""


class AuthenticationError(PagedServeError):
    """UNAUTHENTICATED or PERMISSION_DENIED: a missing or wrong token or certificate."""


class ConflictError(PagedServeError):
    """ALREADY_EXISTS: the request_id is already live."""


class ResourceExhaustedError(PagedServeError):
    """RESOURCE_EXHAUSTED: the queue is full (retry later) or the message is too large."""


class UnavailableError(PagedServeError):
    """UNAVAILABLE: the server is starting, draining, or its executor is gone; retry later."""


class DeadlineExceededError(PagedServeError):
    """DEADLINE_EXCEEDED: the call's timeout passed (the server freed the request)."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: BadRequestError,
    grpc.StatusCode.OUT_OF_RANGE: BadRequestError,
    grpc.StatusCode.FAILED_PRECONDITION: BadRequestError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
    grpc.StatusCode.ALREADY_EXISTS: ConflictError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
}


def _violations(err: grpc.RpcError) -> tuple[FieldViolation, ...]:
    try:
        status = rpc_status.from_call(err)  # grpc.aio's errors have the same sync accessors
    except (ValueError, AttributeError):
        return ()
    out = []
    for detail in status.details if status is not None else ():
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            out += [FieldViolation(v.field, v.description) for v in bad.field_violations]
    return tuple(out)


def from_rpc_error(err: grpc.RpcError) -> PagedServeError:
    """The typed error for a failed grpc call (returned unchanged if already typed)."""
    if isinstance(err, PagedServeError):
        return err
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else str(err)
    return _BY_CODE.get(code, PagedServeError)(code, details or code.name, _violations(err))
