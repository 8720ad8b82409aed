"""The gateway's configuration: parsed once in `main`, frozen, validated.

Precedence as for the services: command-line flag > PAGEDSERVE_<FLAG> > default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.cli_config import EnvArgumentParser
from shared.net import validate_address


@dataclass(frozen=True)
class GatewayConfig:
    listen: str = "127.0.0.1:8000"
    scheduler: str = "127.0.0.1:50051"
    scheduler_tls_ca: str = ""  # PEM CA bundle: reach the scheduler over TLS
    served_model_name: str = ""  # the id /v1/models lists; empty = the scheduler's model_name
    drain_timeout_s: float = 30.0  # SIGTERM: open requests (streams too) get this long to finish
    log_level: str = "info"
    allowed_origins: tuple[str, ...] = ()  # CORS: browser origins allowed to call the API ("*" = any); () = no CORS
    metrics_upstream: tuple[str, ...] = ()  # HOST:PORT of /metrics endpoints that /metrics serves together

    def __post_init__(self) -> None:
        validate_address(self.listen)
        validate_address(self.scheduler)
        for address in self.metrics_upstream:
            validate_address(address)
        if self.drain_timeout_s < 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {self.drain_timeout_s}")


def _split(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def build_parser(environ: Mapping[str, str]) -> EnvArgumentParser:
    """Every flag of this service (`pagedserve serve` routes flags by these parsers)."""
    p = EnvArgumentParser(
        prog="python -m openai_gateway",
        description="OpenAI-compatible HTTP API in front of a PagedServe scheduler. The caller's "
        "Authorization header is passed through to the scheduler, which checks it.",
        environ=environ,
    )
    d = GatewayConfig
    p.add_argument("--listen", default=d.listen, help="HOST:PORT or unix:///path for the HTTP API.")
    p.add_argument("--scheduler", default=d.scheduler, help="The scheduler's public gRPC HOST:PORT or unix:///path.")
    p.add_argument("--scheduler-tls-ca", default=d.scheduler_tls_ca, help="CA bundle to verify a TLS scheduler.")
    p.add_argument(
        "--served-model-name", default=d.served_model_name, help="Model id to list; default: the scheduler's."
    )
    p.add_argument(
        "--drain-timeout", type=float, default=d.drain_timeout_s, help="Seconds open requests get on SIGTERM."
    )
    p.add_argument("--log-level", default=d.log_level, choices=("debug", "info", "warning", "error"))
    p.add_argument("--allowed-origins", default="", help="Comma-separated origins browsers may call from (CORS), or *.")
    p.add_argument(
        "--metrics-upstream",
        default="",
        help="Comma-separated HOST:PORT of the scheduler's (and executor's) /metrics, served at /metrics.",
    )
    return p


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    environ = os.environ if environ is None else environ
    p = build_parser(environ)
    a = p.parse_args(argv)
    try:
        return GatewayConfig(
            listen=a.listen,
            scheduler=a.scheduler,
            scheduler_tls_ca=a.scheduler_tls_ca,
            served_model_name=a.served_model_name,
            drain_timeout_s=a.drain_timeout,
            log_level=a.log_level,
            allowed_origins=_split(a.allowed_origins),
            metrics_upstream=_split(a.metrics_upstream),
        )
    except ValueError as e:
        p.error(str(e))
