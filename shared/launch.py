"""`make run`: start the executor and the scheduler, wait until both serve.

Runs both processes in the foreground (Ctrl-C stops both) and prints how to
send a first request. Flags for each service come from PAGEDSERVE_* variables.
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


def main() -> int:
    env = dict(os.environ)
    procs = [
        subprocess.Popen([sys.executable, "-m", "executor_svc", "--listen", EXECUTOR], env=env),
        subprocess.Popen([sys.executable, "-m", "scheduler_svc", "--listen", PUBLIC, "--executor", EXECUTOR], env=env),
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
    bin_dir = os.path.dirname(sys.executable)
    print(
        f"\nPagedServe is serving on {PUBLIC} (executor on {EXECUTOR}). Try, in another terminal:\n\n"
        f"  {bin_dir}/pagedserve generate --chat \"What is a KV cache, in one sentence?\"\n"
        f"  {bin_dir}/pagedserve generate \"The three laws of thermodynamics are\" --max-tokens 64\n"
        f"  {bin_dir}/pagedserve status\n\nCtrl-C stops both processes.\n",
        flush=True,
    )
    codes = [p.wait() for p in procs]
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
