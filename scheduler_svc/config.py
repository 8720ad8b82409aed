"""The scheduler's configuration: parsed once in `main`, frozen, validated."""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.cli_config import EnvArgumentParser
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
    drain_timeout_s: float = 30.0  # SIGTERM: in-flight requests get this long to finish
    executor_auth_token: str = ""  # shared secret presented to the executor
    auth_tokens: tuple[str, ...] = ()  # accepted public bearer tokens; empty = no auth
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    keepalive_time_s: float = 30.0
    max_connection_age_s: float = 0.0  # 0 = unlimited
    log_level: str = "info"
    log_json: bool | None = None
    metrics_listen: str = ""
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
        if self.grammar_compile_timeout_s <= 0 or self.grammar_compile_workers < 1 or self.grammar_cache_size < 1:
            raise ValueError("--grammar-compile-timeout must be > 0, --grammar-compile-workers and "
                             "--grammar-cache-size >= 1")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")


def _read_tokens(path: str) -> tuple[str, ...]:
    with open(path, encoding="utf-8") as f:
        return tuple(line.strip() for line in f if line.strip())


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> SchedulerServiceConfig:
    environ = os.environ if environ is None else environ
    p = EnvArgumentParser(prog="python -m scheduler_svc", description="PagedServe scheduler: public gRPC API, admission, paged KV block tables, continuous batching.", environ=environ)
    d = SchedulerServiceConfig
    p.add_argument("--listen", default=d.listen, help="HOST:PORT or unix:///path for the public Generation API.")
    p.add_argument("--executor", default=d.executor, help="The executor's HOST:PORT or unix:///path.")
    p.add_argument("--block-size", type=int, default=d.block_size, help="Tokens per KV block.")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="Most requests in one step.")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens, help="Most tokens in one step.")
    p.add_argument("--watermark", type=float, default=d.watermark, help="Fraction of KV blocks kept free when admitting.")
    p.add_argument("--no-prefix-caching", action="store_true", default=False, help="Disable the prefix cache.")
    p.add_argument("--no-chunked-prefill", action="store_true", default=False, help="Never split a prompt across steps.")
    p.add_argument("--no-overlap-scheduling", action="store_true", default=False,
                   help="Plan each step only after the previous one's result (else the next plan is made and sent while a step runs).")
    p.add_argument("--hash-algo", default=d.hash_algo, choices=("sha256", "blake2b"), help="Prefix-cache block hash.")
    p.add_argument("--max-waiting", type=int, default=d.max_waiting, help="Queue limit; beyond it RESOURCE_EXHAUSTED.")
    p.add_argument("--max-n", type=int, default=d.max_n, help="Largest n (samples per request).")
    p.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings)
    p.add_argument("--max-stop-string-bytes", type=int, default=d.max_stop_string_bytes)
    p.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes, help="Largest accepted request message.")
    p.add_argument("--executor-recovery-timeout", type=float, default=d.executor_recovery_timeout_s, help="Seconds clients wait for a lost executor before UNAVAILABLE.")
    p.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s, help="Seconds in-flight requests get on SIGTERM.")
    p.add_argument("--executor-auth-token-file", default="", help="File with the executor's shared secret.")
    p.add_argument("--executor-auth-token", default="", help="The executor's shared secret (prefer the file).")
    p.add_argument("--auth-tokens-file", default="", help="File of accepted bearer tokens, one per line.")
    p.add_argument("--auth-token", default="", help="One accepted bearer token (prefer the file).")
    p.add_argument("--tls-cert", default="", help="PEM certificate chain for the public API.")
    p.add_argument("--tls-key", default="", help="PEM private key for the public API.")
    p.add_argument("--tls-client-ca", default="", help="PEM CA bundle: require client certificates (mutual TLS).")
    p.add_argument("--keepalive-time", type=float, default=d.keepalive_time_s, help="Seconds between keepalive pings.")
    p.add_argument("--max-connection-age", type=float, default=d.max_connection_age_s, help="Seconds before a connection is asked to reconnect (GOAWAY); 0 = never.")
    p.add_argument("--log-level", default=d.log_level, choices=("debug", "info", "warning", "error"))
    p.add_argument("--log-json", action="store_true", default=False, help="Force JSON logs even on a terminal.")
    p.add_argument("--metrics-listen", default=d.metrics_listen, help="HOST:PORT for a Prometheus /metrics endpoint.")
    p.add_argument("--grammar-compile-timeout", type=float, default=d.grammar_compile_timeout_s,
                   help="Seconds a structured-output constraint may take to compile before the request is refused.")
    p.add_argument("--grammar-compile-workers", type=int, default=d.grammar_compile_workers,
                   help="Threads compiling structured-output constraints.")
    p.add_argument("--grammar-cache-size", type=int, default=d.grammar_cache_size,
                   help="Compiled structured-output constraints kept for reuse (LRU).")
    a = p.parse_args(argv)
    executor_token = a.executor_auth_token
    if a.executor_auth_token_file:
        executor_token = _read_tokens(a.executor_auth_token_file)[0]
    tokens = _read_tokens(a.auth_tokens_file) if a.auth_tokens_file else ()
    if a.auth_token:
        tokens += (a.auth_token,)
    try:
        return SchedulerServiceConfig(
            listen=a.listen, executor=a.executor, block_size=a.block_size, max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=a.max_num_batched_tokens, watermark=a.watermark,
            enable_prefix_caching=not a.no_prefix_caching, enable_chunked_prefill=not a.no_chunked_prefill,
            overlap_scheduling=not a.no_overlap_scheduling,
            hash_algo=a.hash_algo, max_waiting=a.max_waiting, max_n=a.max_n, max_stop_strings=a.max_stop_strings,
            max_stop_string_bytes=a.max_stop_string_bytes, max_message_bytes=a.max_message_bytes,
            executor_recovery_timeout_s=a.executor_recovery_timeout, drain_timeout_s=a.drain_timeout,
            executor_auth_token=executor_token, auth_tokens=tokens, tls_cert=a.tls_cert, tls_key=a.tls_key,
            tls_client_ca=a.tls_client_ca, keepalive_time_s=a.keepalive_time, max_connection_age_s=a.max_connection_age,
            log_level=a.log_level, log_json=True if a.log_json else None, metrics_listen=a.metrics_listen,
            grammar_compile_timeout_s=a.grammar_compile_timeout, grammar_compile_workers=a.grammar_compile_workers,
            grammar_cache_size=a.grammar_cache_size,
        )
    except ValueError as e:
        p.error(str(e))
