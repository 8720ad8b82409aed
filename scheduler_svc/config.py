"""The scheduler's configuration: parsed once in `main`, frozen, validated."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.cli_config import EnvArgumentParser
from shared.executor_secret import default_secret_dir, installation_secret
from shared.metrics_http import validate_metrics_prefix
from shared.net import validate_address


@dataclass(frozen=True)
class SchedulerServiceConfig:
    listen: str = "0.0.0.0:50051"
    executor: str = "127.0.0.1:50052"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    overlap_scheduling: bool = True  # plan step N+1 while step N runs
    hash_algo: str = "sha256"
    max_waiting: int = 4096  # queued requests beyond this get RESOURCE_EXHAUSTED
    max_n: int = 16
    max_stop_strings: int = 16
    max_stop_string_bytes: int = 256
    max_message_bytes: int = 4 << 20  # gRPC receive limit for the public API
    executor_recovery_timeout_s: float = 30.0  # clients wait this long for a lost executor
    step_timeout_s: float = 60.0  # a step unanswered this long means the executor is lost (hung)
    drain_timeout_s: float = 30.0  # SIGTERM: in-flight requests get this long to finish
    # The secret presented to the executor: the operator's (--executor-auth-token[-file]),
    # else this installation's in secret_dir. parse_config always sets it.
    executor_auth_token: str = ""
    secret_dir: str = ""  # where this installation's executor secret lives; "" = $XDG_STATE_HOME/pagedserve
    auth_tokens: tuple[str, ...] = ()  # accepted public bearer tokens; empty = no auth
    admin_tokens: tuple[str, ...] = ()  # the subset of auth_tokens that may see every caller's requests
    allow_special_tokens_in_content: bool = False  # chat content may write control tokens (trusted clients only)
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    keepalive_time_s: float = 30.0
    max_connection_age_s: float = 0.0  # 0 = unlimited
    log_level: str = "info"
    log_json: bool | None = None
    metrics_listen: str = ""
    metrics_prefix: str = "pagedserve"  # metric names' namespace; "vllm" for vLLM's dashboards
    served_model_name: str = ""  # the metrics' model_name label; "" = the model's id (shared.model_id)
    log_stats_interval_s: float = 10.0  # a throughput/queue/KV line every this many seconds; 0 = off
    grammar_compile_timeout_s: float = 10.0  # structured output: longer compiles are refused
    grammar_compile_workers: int = 2  # threads compiling grammars off the event loop
    grammar_cache_size: int = 256  # distinct compiled constraints kept (LRU)

    def __post_init__(self) -> None:
        validate_address(self.listen)
        validate_address(self.executor)
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"--block-size must be a power of two 1..128, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("--max-num-seqs and --max-num-batched-tokens must be >= 1")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"--watermark must be in [0, 1), got {self.watermark}")
        if self.hash_algo not in ("sha256", "blake2b"):
            raise ValueError(f"--hash-algo must be sha256 or blake2b, got {self.hash_algo!r}")
        if self.max_waiting < 1 or self.max_n < 1:
            raise ValueError("--max-waiting and --max-n must be >= 1")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if not self.step_timeout_s > 0 or not self.executor_recovery_timeout_s >= 0:
            raise ValueError("--step-timeout must be > 0 and --executor-recovery-timeout >= 0")
        if not set(self.admin_tokens) <= set(self.auth_tokens):
            raise ValueError("every admin token must also be an accepted token")
        validate_metrics_prefix(self.metrics_prefix)
        if self.log_stats_interval_s < 0:
            raise ValueError(f"--log-stats-interval must be >= 0, got {self.log_stats_interval_s}")
        if self.grammar_compile_timeout_s <= 0 or self.grammar_compile_workers < 1 or self.grammar_cache_size < 1:
            raise ValueError(
                "--grammar-compile-timeout must be > 0, --grammar-compile-workers and --grammar-cache-size >= 1"
            )
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")


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
    lines = _read_lines(path, "--executor-auth-token-file")
    if len(lines) > 1 or len(lines[0][1].split()) != 1:
        raise TokenFileError(f"--executor-auth-token-file {path}: expected exactly one token on one line")
    return lines[0][1]


def build_parser(environ: Mapping[str, str]) -> EnvArgumentParser:
    """Every flag of this service (`pagedserve serve` routes flags by these parsers)."""
    p = EnvArgumentParser(
        prog="python -m scheduler_svc",
        description="PagedServe scheduler: public gRPC API, admission, paged KV block tables, continuous batching.",
        environ=environ,
    )
    d = SchedulerServiceConfig
    p.add_argument("--listen", default=d.listen, help="HOST:PORT or unix:///path for the public Generation API.")
    p.add_argument("--executor", default=d.executor, help="The executor's HOST:PORT or unix:///path.")
    p.add_argument("--block-size", type=int, default=d.block_size, help="Tokens per KV block.")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="Most requests in one step.")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens, help="Most tokens in one step."
    )
    p.add_argument(
        "--watermark", type=float, default=d.watermark, help="Fraction of KV blocks kept free when admitting."
    )
    p.add_argument("--no-prefix-caching", action="store_true", default=False, help="Disable the prefix cache.")
    p.add_argument(
        "--no-chunked-prefill", action="store_true", default=False, help="Never split a prompt across steps."
    )
    p.add_argument(
        "--no-overlap-scheduling",
        action="store_true",
        default=False,
        help="Plan each step only after the previous one's result (else the next plan is made and sent while a step runs).",
    )
    p.add_argument("--hash-algo", default=d.hash_algo, choices=("sha256", "blake2b"), help="Prefix-cache block hash.")
    p.add_argument("--max-waiting", type=int, default=d.max_waiting, help="Queue limit; beyond it RESOURCE_EXHAUSTED.")
    p.add_argument("--max-n", type=int, default=d.max_n, help="Largest n (samples per request).")
    p.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings)
    p.add_argument("--max-stop-string-bytes", type=int, default=d.max_stop_string_bytes)
    p.add_argument(
        "--max-message-bytes", type=int, default=d.max_message_bytes, help="Largest accepted request message."
    )
    p.add_argument(
        "--executor-recovery-timeout",
        type=float,
        default=d.executor_recovery_timeout_s,
        help="Seconds clients wait for a lost executor before UNAVAILABLE.",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=d.step_timeout_s,
        help="Seconds a step may go unanswered before the executor counts as lost (hung); size it above the slowest legitimate step.",
    )
    p.add_argument(
        "--drain-timeout", type=float, default=d.drain_timeout_s, help="Seconds in-flight requests get on SIGTERM."
    )
    p.add_argument(
        "--executor-auth-token-file",
        default="",
        help="File with the executor's secret. Without it, this installation's secret in --secret-dir is used.",
    )
    p.add_argument("--executor-auth-token", default="", help="The executor's secret (prefer the file).")
    p.add_argument(
        "--secret-dir",
        default=d.secret_dir,
        help="Private directory (0700) of this installation's executor secret, shared with the executor. "
        "Default: $XDG_STATE_HOME/pagedserve (~/.local/state/pagedserve).",
    )
    p.add_argument(
        "--auth-tokens-file",
        default="",
        help="File of accepted bearer tokens: `TOKEN` or `TOKEN admin` per line, # comments (docs/hardening.md).",
    )
    p.add_argument("--auth-token", default="", help="One accepted bearer token (prefer the file).")
    p.add_argument(
        "--allow-special-tokens-in-content",
        action="store_true",
        default=False,
        help="Let chat message content write control tokens such as <|im_start|> (trusted clients only; else they are text).",
    )
    p.add_argument("--tls-cert", default="", help="PEM certificate chain for the public API.")
    p.add_argument("--tls-key", default="", help="PEM private key for the public API.")
    p.add_argument("--tls-client-ca", default="", help="PEM CA bundle: require client certificates (mutual TLS).")
    p.add_argument("--keepalive-time", type=float, default=d.keepalive_time_s, help="Seconds between keepalive pings.")
    p.add_argument(
        "--max-connection-age",
        type=float,
        default=d.max_connection_age_s,
        help="Seconds before a connection is asked to reconnect (GOAWAY); 0 = never.",
    )
    p.add_argument("--log-level", default=d.log_level, choices=("debug", "info", "warning", "error"))
    p.add_argument("--log-json", action="store_true", default=False, help="Force JSON logs even on a terminal.")
    p.add_argument("--metrics-listen", default=d.metrics_listen, help="HOST:PORT for a Prometheus /metrics endpoint.")
    p.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=d.grammar_compile_timeout_s,
        help="Seconds a structured-output constraint may take to compile before the request is refused.",
    )
    p.add_argument(
        "--grammar-compile-workers",
        type=int,
        default=d.grammar_compile_workers,
        help="Threads compiling structured-output constraints.",
    )
    p.add_argument(
        "--grammar-cache-size",
        type=int,
        default=d.grammar_cache_size,
        help="Compiled structured-output constraints kept for reuse (LRU).",
    )
    p.add_argument(
        "--metrics-prefix", default=d.metrics_prefix, help="Metric name prefix (`vllm` for vLLM's dashboards)."
    )
    p.add_argument(
        "--served-model-name",
        default=d.served_model_name,
        help="The metrics' model_name label; default: the model's id.",
    )
    p.add_argument(
        "--log-stats-interval",
        type=float,
        default=d.log_stats_interval_s,
        help="Seconds between stats lines (throughput, running/waiting, KV usage, prefix hits); 0 = off.",
    )
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
    except TokenFileError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")  # one line, no usage text: the flags were fine, the file is not
    try:
        executor_token = executor_token or installation_secret(a.secret_dir or default_secret_dir(environ))
    except (OSError, ValueError) as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    if a.auth_token:
        tokens += (a.auth_token,)
    try:
        return SchedulerServiceConfig(
            listen=a.listen,
            executor=a.executor,
            block_size=a.block_size,
            max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=a.max_num_batched_tokens,
            watermark=a.watermark,
            enable_prefix_caching=not a.no_prefix_caching,
            enable_chunked_prefill=not a.no_chunked_prefill,
            overlap_scheduling=not a.no_overlap_scheduling,
            hash_algo=a.hash_algo,
            max_waiting=a.max_waiting,
            max_n=a.max_n,
            max_stop_strings=a.max_stop_strings,
            max_stop_string_bytes=a.max_stop_string_bytes,
            max_message_bytes=a.max_message_bytes,
            executor_recovery_timeout_s=a.executor_recovery_timeout,
            step_timeout_s=a.step_timeout,
            drain_timeout_s=a.drain_timeout,
            executor_auth_token=executor_token,
            secret_dir=a.secret_dir,
            auth_tokens=tokens,
            admin_tokens=admins,
            allow_special_tokens_in_content=a.allow_special_tokens_in_content,
            tls_cert=a.tls_cert,
            tls_key=a.tls_key,
            tls_client_ca=a.tls_client_ca,
            keepalive_time_s=a.keepalive_time,
            max_connection_age_s=a.max_connection_age,
            log_level=a.log_level,
            log_json=True if a.log_json else None,
            metrics_listen=a.metrics_listen,
            metrics_prefix=a.metrics_prefix,
            served_model_name=a.served_model_name,
            log_stats_interval_s=a.log_stats_interval,
            grammar_compile_timeout_s=a.grammar_compile_timeout,
            grammar_compile_workers=a.grammar_compile_workers,
            grammar_cache_size=a.grammar_cache_size,
        )
    except ValueError as e:
        p.error(str(e))
