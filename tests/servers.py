"""Starts real executor and scheduler processes for end-to-end tests.

The internal hop uses a Unix socket in a temporary directory and the public
API a free loopback port, so parallel test runs never collide. Both processes
find their shared executor secret in that directory too (PAGEDSERVE_SECRET_DIR),
not in the user's own state directory.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2

from pagedserve_client import Client

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_status(target: str, service: str = "", timeout: float = 1.0) -> int | None:
    try:
        with Client(target) as c:
            return c.health(service, timeout=timeout)
    except grpc.RpcError:
        return None


def wait_serving(target: str, procs, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while health_status(target) != health_pb2.HealthCheckResponse.SERVING:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args} exited with {p.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{target} not SERVING after {timeout}s")
        time.sleep(0.2)


@dataclass
class Servers:
    executor_args: list[str] = field(default_factory=list)
    scheduler_args: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)

    def __post_init__(self):
        self.tmp = tempfile.mkdtemp(prefix="pagedserve-")
        self.executor_addr = f"unix://{self.tmp}/executor.sock"
        self.secret_dir = os.path.join(self.tmp, "secret")
        self.public_addr = f"127.0.0.1:{free_port()}"
        self.executor: subprocess.Popen | None = None
        self.scheduler: subprocess.Popen | None = None

    def _spawn(self, module: str, args: list[str], log_name: str) -> subprocess.Popen:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PAGEDSERVE_SECRET_DIR": self.secret_dir, **self.env}
        log = open(os.path.join(self.tmp, log_name), "ab")
        return subprocess.Popen(
            [sys.executable, "-m", module, *args], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
        )

    def executor_metadata(self) -> tuple[tuple[str, str], ...]:
        """What a hand-driven call to the executor needs: its secret, as the scheduler presents it."""
        from shared.executor_secret import installation_secret

        return (("authorization", f"Bearer {installation_secret(self.secret_dir)}"),)

    def start_executor(self) -> None:
        self.executor = self._spawn(
            "executor_svc", ["--listen", self.executor_addr, *self.executor_args], "executor.log"
        )

    def start(self, timeout: float = 180.0) -> Servers:
        self.start_executor()
        self.scheduler = self._spawn(
            "scheduler_svc",
            ["--listen", self.public_addr, "--executor", self.executor_addr, *self.scheduler_args],
            "scheduler.log",
        )
        try:
            wait_serving(self.public_addr, [self.executor, self.scheduler], timeout)
        except (RuntimeError, TimeoutError) as e:
            tails = "\n".join(f"--- {n} log ---\n{self.logs(n)[-3000:]}" for n in ("executor", "scheduler"))
            self.stop()
            raise RuntimeError(f"{e}\n{tails}") from e
        return self

    def logs(self, name: str) -> str:
        with open(os.path.join(self.tmp, f"{name}.log"), errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        for p in (self.scheduler, self.executor):
            if p is not None and p.poll() is None:
                p.terminate()
        for p in (self.scheduler, self.executor):
            if p is not None:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
