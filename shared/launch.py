"""`make run`: start the executor and the scheduler, wait until both serve.

Runs both processes in the foreground (Ctrl-C stops both) and prints how to
send a first request. Flags for each service come from PAGEDSERVE_* variables,
which here both processes see. Three flags exist in both services with
different meanings, so `child_envs` routes their variables:

    PAGEDSERVE_LISTEN                   the public API (the executor gets PAGEDSERVE_EXECUTOR)
    PAGEDSERVE_METRICS_LISTEN           the scheduler's /metrics
    PAGEDSERVE_EXECUTOR_METRICS_LISTEN  the executor's /metrics
    PAGEDSERVE_AUTH_TOKEN               a client bearer token (the scheduler's)
    PAGEDSERVE_EXECUTOR_AUTH_TOKEN[_FILE]  the internal hop's secret: both get it

Without that secret both processes use this installation's, generated on
first start in the same private directory (PAGEDSERVE_SECRET_DIR, default
~/.local/state/pagedserve; shared/executor_secret.py): nothing to configure.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2

from pagedserve_client import Client

EXECUTOR = os.environ.get("PAGEDSERVE_EXECUTOR", "127.0.0.1:50052")
PUBLIC = os.environ.get("PAGEDSERVE_LISTEN", "127.0.0.1:50051")


def serving(target: str) -> bool:
    try:
        with Client(target) as c:
            return c.health(timeout=1.0) == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def child_envs(environ: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(executor's, scheduler's) environment, each variable reaching the process it means."""
    executor = {k: v for k, v in environ.items() if k not in ("PAGEDSERVE_METRICS_LISTEN", "PAGEDSERVE_AUTH_TOKEN")}
    for name in ("METRICS_LISTEN", "AUTH_TOKEN", "AUTH_TOKEN_FILE"):
        value = environ.get(f"PAGEDSERVE_EXECUTOR_{name}")
        if value is not None:
            executor[f"PAGEDSERVE_{name}"] = value
    return executor, dict(environ)


def main() -> int:
    executor_env, scheduler_env = child_envs(dict(os.environ))
    procs = [
        subprocess.Popen([sys.executable, "-m", "executor_svc", "--listen", EXECUTOR], env=executor_env),
        subprocess.Popen([sys.executable, "-m", "scheduler_svc", "--listen", PUBLIC, "--executor", EXECUTOR],
                         env=scheduler_env),
    ]

    def stop(*_):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    deadline = time.monotonic() + 300
    while not serving(PUBLIC):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            stop()
            print("PagedServe failed to start; see the logs above.", file=sys.stderr)
            return 1
        time.sleep(0.5)
    cli = os.path.join(os.path.dirname(sys.executable), "pagedserve")
    if PUBLIC != "127.0.0.1:50051":  # the CLI's default target
        cli += f" --target {PUBLIC}"
    if "PAGEDSERVE_AUTH_TOKEN" in scheduler_env or "PAGEDSERVE_AUTH_TOKENS_FILE" in scheduler_env:
        cli += " --token YOUR_TOKEN"
    print(
        f"\nPagedServe is serving on {PUBLIC} (executor on {EXECUTOR}). Try, in another terminal:\n\n"
        f"  {cli} generate --chat \"What is a KV cache, in one sentence?\"\n"
        f"  {cli} generate \"The three laws of thermodynamics are\" --max-tokens 64\n"
        f"  {cli} status\n\nCtrl-C stops both processes.\n",
        flush=True,
    )
    codes = [p.wait() for p in procs]
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
