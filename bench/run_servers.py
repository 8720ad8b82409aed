"""Starts the engine a suite measures: real executor and scheduler processes.

Bench drives PagedServe only through its CLI flags and the public gRPC API,
so the engine's internals can change under it. The processes are started by
the same helper the end-to-end tests use (tests/servers.py: a Unix socket for
the internal hop, a free loopback port for the public API); `--target` skips
the launch and measures a server someone else started.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from tests.servers import Servers

STARTUP_TIMEOUT_S = 600.0  # model loading on a busy 2-core machine can take minutes


@dataclass(frozen=True)
class EngineFlags:
    """The flags a suite sets; None leaves the server's default."""

    dtype: str = "float32"
    num_threads: int = 0
    kv_cache_gib: float | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    prefix_caching: bool = True
    overlap_scheduling: bool = True
    deterministic: bool = False
    kv_cache_dtype: str | None = None

    def executor_args(self) -> list[str]:
        args = ["--dtype", self.dtype, "--num-threads", str(self.num_threads)]
        if self.kv_cache_dtype is not None:
            args += ["--kv-cache-dtype", self.kv_cache_dtype]
        if self.deterministic:
            args.append("--deterministic")
        if self.kv_cache_gib is not None:
            args += ["--kv-cache-gib", str(self.kv_cache_gib)]
        if self.max_model_len is not None:
            args += ["--max-model-len", str(self.max_model_len)]
        return args

    def scheduler_args(self) -> list[str]:
        args = []
        for flag, value in (
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
            ("--block-size", self.block_size),
        ):
            if value is not None:
                args += [flag, str(value)]
        if not self.prefix_caching:
            args.append("--no-prefix-caching")
        if not self.overlap_scheduling:
            args.append("--no-overlap-scheduling")
        return args

    def as_dict(self) -> dict:
        return dict(asdict(self), executor_args=self.executor_args(), scheduler_args=self.scheduler_args())


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.splitlines()[-lines:])


@contextmanager
def running_engine(flags: EngineFlags, target: str | None = None) -> Iterator[str]:
    """Yields the public address of a serving engine; stops what it started."""
    if target:
        yield target
        return
    servers = Servers(executor_args=flags.executor_args(), scheduler_args=flags.scheduler_args())
    try:
        servers.start(timeout=STARTUP_TIMEOUT_S)
    except Exception:
        for name in ("executor", "scheduler"):
            try:
                print(f"--- {name} log (tail) ---\n{_tail(servers.logs(name))}", file=sys.stderr)
            except OSError:
                pass
        servers.stop()
        raise
    try:
        yield servers.public_addr
    finally:
        servers.stop()
