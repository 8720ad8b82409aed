"""Python client for the PagedServe gRPC API (sync and asyncio). Needs no torch."""

from pagedserve_client.client import AsyncClient, Client, GenerateStream, build_request
from pagedserve_client.errors import (
    AuthenticationError,
    BadRequestError,
    ConflictError,
    DeadlineExceededError,
    FieldViolation,
    PagedServeError,
    ResourceExhaustedError,
    UnavailableError,
)
from pagedserve_client.results import Completion, TokenLogprob, TopLogprob, Usage

__all__ = [
    "AsyncClient",
    "AuthenticationError",
    "BadRequestError",
    "Client",
    "Completion",
    "ConflictError",
    "DeadlineExceededError",
    "FieldViolation",
    "GenerateStream",
    "PagedServeError",
    "ResourceExhaustedError",
    "TokenLogprob",
    "TopLogprob",
    "UnavailableError",
    "Usage",
    "build_request",
]
