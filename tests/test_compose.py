"""`docker compose up` for real: deploy/compose-smoke.sh builds the image,
brings executor, scheduler and gateway up, waits until they are healthy,
sends a gRPC request and an OpenAI request from the host, checks the executor
is unreachable from the host and stops the stack (docs/deployment.md).

Skipped where no Docker engine (or no compose) is reachable, as in CI; the
first build takes minutes, later ones reuse Docker's layer cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.servers import REPO


def _works(*cmd: str) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def docker_with_compose() -> bool:
    return (
        shutil.which("docker") is not None
        and _works("docker", "info")
        and (_works("docker", "compose", "version") or _works("docker-compose", "version"))
    )


pytestmark = [
    pytest.mark.docker,
    pytest.mark.slow,
    pytest.mark.skipif(not docker_with_compose(), reason="no Docker engine with compose reachable"),
]


@pytest.mark.timeout(3600)
def test_compose_up_serves_grpc_and_openai_and_hides_the_executor():
    cli = os.path.join(os.path.dirname(sys.executable), "pagedserve")
    done = subprocess.run(
        [os.path.join(REPO, "deploy", "compose-smoke.sh")],
        env={**os.environ, "PAGEDSERVE_CLI": cli},
        capture_output=True,
        text=True,
        timeout=3500,
    )
    assert done.returncode == 0 and "compose-smoke: OK" in done.stdout, (done.stdout[-6000:], done.stderr[-6000:])
