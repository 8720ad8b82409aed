"""The scheduler's configuration: parsed once in `main`, frozen, validated.

Each field is declared once (shared/config_fields.py); the scheduling policy's
fields (--block-size, --watermark, ...) are declared in scheduler_config.py
and nested here as `scheduler`, which the engine hands to the scheduler core.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from scheduler_svc.scheduler_config import SchedulerPolicy
from shared.cli_config import EnvArgumentParser
from shared.config_fields import above, at_least, check_options, config_from, option, parser_for
from shared.executor_secret import default_secret_dir, installation_secret, read_secret_file
from shared.logging import LOG_LEVELS
from shared.metrics_http import validate_metrics_prefix
from shared.net import validate_address


@dataclass(frozen=True)
class SchedulerServiceConfig:
    listen: str = option(
        "0.0.0.0:50051", help="HOST:PORT or unix:///path for the public Generation API.", check=validate_address
    )
    executor: str = option("127.0.0.1:50052", help="The executor's HOST:PORT or unix:///path.", check=validate_address)
    scheduler: SchedulerPolicy = field(default_factory=SchedulerPolicy)  # --block-size, --max-num-seqs, ...
    overlap_scheduling: bool = option(
        True,
        flag="--no-overlap-scheduling",
        help="Plan each step only after the previous one's result (else the next plan is made and sent while a step runs).",
    )
    max_waiting: int = option(4096, help="Queue limit; beyond it RESOURCE_EXHAUSTED.", check=at_least(1))
    max_n: int = option(16, help="Largest n (samples per request).", check=at_least(1))
    max_stop_strings: int = option(16)
    max_stop_string_bytes: int = option(256)
    max_message_bytes: int = option(4 << 20, help="Largest accepted request message.")  # the public API's gRPC limit
    executor_recovery_timeout_s: float = option(
        30.0, help="Seconds clients wait for a lost executor before UNAVAILABLE.", check=at_least(0)
    )
    step_timeout_s: float = option(
        60.0,
        help="Seconds a step may go unanswered before the executor counts as lost (hung); "
        "size it above the slowest legitimate step.",
        check=above(0),
    )
    drain_timeout_s: float = option(30.0, help="Seconds in-flight requests get on SIGTERM.")
    # The secret presented to the executor: --executor-auth-token-file's, else this
    # flag's, else this installation's in secret_dir. parse_config always sets it.
    executor_auth_token: str = option("", help="The executor's secret (prefer the file).")
    secret_dir: str = option(
        "",
        help="Private directory (0700) of this installation's executor secret, shared with the executor. "
        "Default: $XDG_STATE_HOME/pagedserve (~/.local/state/pagedserve).",
    )
    auth_tokens: tuple[str, ...] = ()  # accepted public bearer tokens (--auth-tokens-file, --auth-token); () = no auth
    admin_tokens: tuple[str, ...] = ()  # the subset of auth_tokens that may see every caller's requests
    allow_special_tokens_in_content: bool = option(
        False,
        help="Let chat message content write control tokens such as <|im_start|> (trusted clients only; else they are text).",
    )
    tls_cert: str = option("", help="PEM certificate chain for the public API.")
    tls_key: str = option("", help="PEM private key for the public API.")
    tls_client_ca: str = option("", help="PEM CA bundle: require client certificates (mutual TLS).")
    keepalive_time_s: float = option(30.0, help="Seconds between keepalive pings.")
    max_connection_age_s: float = option(
        0.0, help="Seconds before a connection is asked to reconnect (GOAWAY); 0 = never."
    )
    log_level: str = option("info", choices=LOG_LEVELS)
    log_json: bool | None = option(None, help="Force JSON logs even on a terminal.")  # None: JSON unless a terminal
    metrics_listen: str = option("", help="HOST:PORT for a Prometheus /metrics endpoint.")
    grammar_compile_timeout_s: float = option(
        10.0,
        help="Seconds a structured-output constraint may take to compile before the request is refused.",
        check=above(0),
    )
    grammar_compile_workers: int = option(2, help="Threads compiling structured-output constraints.", check=at_least(1))
    grammar_cache_size: int = option(
        256, help="Compiled structured-output constraints kept for reuse (LRU).", check=at_least(1)
    )
    metrics_prefix: str = option(
        "pagedserve", help="Metric name prefix (`vllm` for vLLM's dashboards).", check=validate_metrics_prefix
    )
    served_model_name: str = option("", help="The metrics' model_name label; default: the model's id.")
    log_stats_interval_s: float = option(
        10.0,
        help="Seconds between stats lines (throughput, running/waiting, KV usage, prefix hits); 0 = off.",
        check=at_least(0),
    )

    def __post_init__(self) -> None:
        check_options(self)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        if not set(self.admin_tokens) <= set(self.auth_tokens):
            raise ValueError("every admin token must also be an accepted token")


class TokenFileError(ValueError):
    """A token file that would weaken authentication if used: the scheduler refuses to start."""


def _read_lines(path: str, flag: str) -> list[tuple[int, str]]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(n, line.strip()) for n, line in enumerate(f, 1)]
    except (OSError, UnicodeDecodeError) as e:
        raise TokenFileError(
            f"{flag} {path}: cannot read it ({e.__class__.__name__}: {getattr(e, 'strerror', None) or e})"
        ) from e
    lines = [(n, line) for n, line in lines if line and not line.startswith("#")]
    if not lines:
        raise TokenFileError(f"{flag} {path}: the file holds no token; refusing to start")
    return lines


def read_auth_tokens(path: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tokens, admin tokens) from a tokens file: one `TOKEN [admin]` per line, `#` comments.

    A plain line is a normal token, as before admin marks existed. Anything else
    on a line is refused (naming the line, never the token).
    """
    tokens, admins = [], []
    for n, line in _read_lines(path, "--auth-tokens-file"):
        fields = line.split()
        if len(fields) > 2 or (len(fields) == 2 and fields[1] != "admin"):
            raise TokenFileError(f"--auth-tokens-file {path} line {n}: expected `TOKEN` or `TOKEN admin`")
        tokens.append(fields[0])
        if len(fields) == 2:
            admins.append(fields[0])
    return tuple(tokens), tuple(admins)


def read_executor_token(path: str) -> str:
    """The executor's secret, read exactly as the executor reads its --auth-token-file."""
    _read_lines(path, "--executor-auth-token-file")  # unreadable or empty: the scheduler's wording
    try:
        return read_secret_file(path)
    except ValueError as e:
        raise TokenFileError(f"--executor-auth-token-file {e}") from e


def build_parser(environ: Mapping[str, str]) -> EnvArgumentParser:
    """Every flag of this service (`pagedserve serve` routes flags by these parsers)."""
    p = parser_for(
        SchedulerServiceConfig,
        environ,
        prog="python -m scheduler_svc",
        description="PagedServe scheduler: public gRPC API, admission, paged KV block tables, continuous batching.",
    )
    # Where the token fields come from (read in parse_config), not fields themselves.
    p.add_argument(
        "--executor-auth-token-file",
        default="",
        help="File with the executor's secret. Without it, this installation's secret in --secret-dir is used.",
    )
    p.add_argument(
        "--auth-tokens-file",
        default="",
        help="File of accepted bearer tokens: `TOKEN` or `TOKEN admin` per line, # comments (docs/hardening.md).",
    )
    p.add_argument("--auth-token", default="", help="One accepted bearer token (prefer the file).")
    return p


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> SchedulerServiceConfig:
    environ = os.environ if environ is None else environ
    p = build_parser(environ)
    a = p.parse_args(argv)
    try:
        executor_token = (
            read_executor_token(a.executor_auth_token_file) if a.executor_auth_token_file else a.executor_auth_token
        )
        tokens, admins = read_auth_tokens(a.auth_tokens_file) if a.auth_tokens_file else ((), ())
        executor_token = executor_token or installation_secret(a.secret_dir or default_secret_dir(environ))
    except (OSError, ValueError) as e:  # TokenFileError included
        p.exit(2, f"{p.prog}: error: {e}\n")  # one line, no usage text: the flags were fine, the file is not
    if a.auth_token:
        tokens += (a.auth_token,)
    return config_from(
        SchedulerServiceConfig, p, a, executor_auth_token=executor_token, auth_tokens=tokens, admin_tokens=admins
    )
