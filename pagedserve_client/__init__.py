"""Python client for the PagedServe gRPC API (sync and asyncio)."""
from pagedserve_client.client import AsyncClient, Client, Completion, GenerateStream, build_request

__all__ = ["AsyncClient", "Client", "Completion", "GenerateStream", "build_request"]
