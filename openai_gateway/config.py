"""The gateway's configuration: parsed once in `main`, frozen, validated.

Precedence as for the services: command-line flag > PAGEDSERVE_<FLAG> > default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.cli_config import EnvArgumentParser
from shared.config_fields import at_least, check_options, config_from, option, parser_for
from shared.logging import LOG_LEVELS
from shared.net import validate_address


def _addresses(addresses: tuple[str, ...]) -> None:
    for address in addresses:
        validate_address(address)


@dataclass(frozen=True)
class GatewayConfig:
    listen: str = option("127.0.0.1:8000", help="HOST:PORT or unix:///path for the HTTP API.", check=validate_address)
    scheduler: str = option(
        "127.0.0.1:50051", help="The scheduler's public gRPC HOST:PORT or unix:///path.", check=validate_address
    )
    scheduler_tls_ca: str = option("", help="CA bundle to verify a TLS scheduler.")  # "" = plaintext
    served_model_name: str = option("", help="Model id to list; default: the scheduler's.")
    drain_timeout_s: float = option(30.0, help="Seconds open requests get on SIGTERM.", check=at_least(0))
    log_level: str = option("info", choices=LOG_LEVELS)
    allowed_origins: tuple[str, ...] = option(  # () = no CORS
        (), help="Comma-separated origins browsers may call from (CORS), or *."
    )
    metrics_upstream: tuple[str, ...] = option(
        (),
        help="Comma-separated HOST:PORT of the scheduler's (and executor's) /metrics, served at /metrics.",
        check=_addresses,
    )

    def __post_init__(self) -> None:
        check_options(self)


def build_parser(environ: Mapping[str, str]) -> EnvArgumentParser:
    """Every flag of this service (`pagedserve serve` routes flags by these parsers)."""
    return parser_for(
        GatewayConfig,
        environ,
        prog="python -m openai_gateway",
        description="OpenAI-compatible HTTP API in front of a PagedServe scheduler. The caller's "
        "Authorization header is passed through to the scheduler, which checks it.",
    )


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    p = build_parser(os.environ if environ is None else environ)
    return config_from(GatewayConfig, p, p.parse_args(argv))
