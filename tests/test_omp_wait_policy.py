"""--omp-wait-policy: how the executor's idle OpenMP threads wait.

The setting only works if it reaches the OpenMP runtime before torch loads it,
so the behavioural test runs a fresh interpreter: after a parallel torch op,
an idle thread under `active` keeps spinning (CPU time while the process only
sleeps), under `passive` it sleeps.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from executor_svc.config import parse_config

IDLE_CPU = """
import sys, time
from executor_svc.__main__ import set_omp_wait_policy
set_omp_wait_policy(sys.argv[1])
import torch
torch.set_num_threads(2)
x = torch.rand(4_000_000)
for _ in range(20):
    torch.exp(x)  # an OpenMP parallel region over both threads
t0 = time.process_time()
time.sleep(0.5)
print(time.process_time() - t0)
"""


def test_default_is_the_runtimes_and_the_flag_and_env_choose():
    assert parse_config([], environ={}).omp_wait_policy == "default"
    assert parse_config(["--omp-wait-policy", "active"], environ={}).omp_wait_policy == "active"
    assert parse_config([], environ={"PAGEDSERVE_OMP_WAIT_POLICY": "passive"}).omp_wait_policy == "passive"
    with pytest.raises(SystemExit):
        parse_config(["--omp-wait-policy", "spin"], environ={})


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="an active wait spins only with a core for each thread")
def test_the_policy_reaches_the_openmp_runtime():
    def idle_cpu_s(policy: str) -> float:
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        out = subprocess.run(
            [sys.executable, "-c", IDLE_CPU, policy], env=env, capture_output=True, text=True, timeout=120, check=True
        )
        return float(out.stdout.split()[-1])

    # 0.5 s asleep: a spinning thread burns about that much CPU, a sleeping one none.
    assert idle_cpu_s("active") > 0.25
    assert idle_cpu_s("passive") < 0.05
