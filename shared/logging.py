"""structlog set-up shared by every service.

JSON lines when stderr is not a terminal (containers, log shippers), readable
console output on a terminal. Request ids are bound with
`structlog.contextvars.bind_contextvars` so every line of a request carries it.
Records of standard-library loggers (uvicorn's, grpc's) go through the same
renderer, so one process writes one format. Prompt and output text are never
logged at INFO or above.
"""

from __future__ import annotations

import logging
import sys

import structlog

LOG_LEVELS = ("debug", "info", "warning", "error")  # every service's --log-level choices


def configure_logging(level: str = "info", json: bool | None = None, service: str = "") -> None:
    if json is None:
        json = not sys.stderr.isatty()
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")

    def add_service(_, __, event: dict) -> dict:
        # Not a contextvar: the forward-pass thread must carry it too.
        event.setdefault("service", service)
        return event

    common = [
        structlog.contextvars.merge_contextvars,
        *([add_service] if service else []),
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if json:
        render = [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        # Plain tracebacks: rich ones print local variables, which hold prompts.
        render = [
            structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback)
        ]
    structlog.configure(
        processors=common + render,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*common, structlog.stdlib.add_logger_name],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *render],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(numeric)
