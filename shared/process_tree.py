"""The `pagedserve serve` process tree: the services as children, started and stopped in order.

Each child runs in its own process group, so that a terminal's Ctrl-C reaches
only the launcher, which stops them in order: the gateway and the scheduler
first (they drain open requests), then the executor. The children die with
the launcher even if it is killed (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Mapping

from shared.serve_flags import EXECUTOR, GATEWAY, SCHEDULER


def say(text: str) -> None:
    """The launcher's own messages, on stderr among its children's logs."""
    print(f"[pagedserve] {text}", file=sys.stderr, flush=True)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the launcher dies, however it dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Tree:
    """The child processes, started and stopped in order."""

    def __init__(self):
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, args: list[str], env: Mapping[str, str]) -> None:
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", name, *args], env=dict(env), process_group=0, preexec_fn=_die_with_parent
        )
        say(f"started {name} (pid {self.procs[name].pid})")

    def exited(self) -> str | None:
        return next((name for name, p in self.procs.items() if p.poll() is not None), None)

    def stop(self, timeout_s: float) -> int:
        """SIGTERM the front (gateway, scheduler: they drain) and then the executor; the worst exit code."""
        worst = 0
        for wave in ((GATEWAY, SCHEDULER), (EXECUTOR,)):
            names = [n for n in wave if n in self.procs]
            for name in names:
                if self.procs[name].poll() is None:
                    self.procs[name].send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for name in names:
                p = self.procs[name]
                try:
                    code = p.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    say(f"{name} did not stop within {timeout_s:.0f} s; killing it")
                    p.kill()
                    code = p.wait()
                # uvicorn re-raises the SIGTERM it handled once it has shut down: that is a clean stop too.
                if code not in (0, -signal.SIGTERM):
                    say(f"{name} exited with code {code}")
                    worst = worst or code
        return worst
