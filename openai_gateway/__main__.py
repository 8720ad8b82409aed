"""`python -m openai_gateway`: serve the OpenAI HTTP API with uvicorn."""

from __future__ import annotations

import sys

from openai_gateway.config import parse_config
from shared.logging import configure_logging


def _bind(listen: str) -> dict:
    """uvicorn's keywords for a validated address: `unix:///path` or `HOST:PORT` / `[v6]:PORT`."""
    if listen.startswith("unix:"):
        path = listen[len("unix:") :]
        return {"uds": path[2:] if path.startswith("///") else path}
    host, _, port = listen.rpartition(":")
    return {"host": host.strip("[]"), "port": int(port)}


def main(argv=None) -> int:
    config = parse_config(argv)
    configure_logging(config.log_level, service="openai_gateway")
    import uvicorn

    from openai_gateway.app import create_app

    # log_config=None: uvicorn's own loggers go through the handler configure_logging put on
    # the root logger, so its lines have the same format as everything else (JSON or console).
    uvicorn.run(
        create_app(config),
        log_level=config.log_level,
        timeout_graceful_shutdown=config.drain_timeout_s,
        log_config=None,
        **_bind(config.listen),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
