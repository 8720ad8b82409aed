"""--omp-wait-policy: how the executor's idle OpenMP threads wait.

The setting only works if it reaches the OpenMP runtime before torch loads it,
so the behavioural test runs a fresh interpreter: after a parallel torch op,
an idle thread under `active` keeps spinning (CPU time while the process only
sleeps), under `passive` it sleeps.

The wait also depends on where the executor runs parallel regions: libgomp
keeps a worker pool for every thread that ran one, and once its threads
outnumber the CPUs it cuts every spin short, whatever the policy. So a served
executor, which loads and steps its model on one thread, must still spin
under `active` after a request.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from executor_svc.config import parse_config
from executor_svc.server import FORWARD_THREAD_NAME
from pagedserve_client import Client
from tests.servers import Servers

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


def cpu_s_by_thread_name(pid: int) -> dict[str, float]:
    """utime + stime of each of the process's threads, summed by the thread's OS name."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
    reason="libgomp throttles spinning on fewer CPUs than threads; thread names are read from Linux's /proc",
)
def test_a_served_executors_openmp_workers_belong_to_its_forward_thread_and_spin():
    # Were the model loaded on another thread than the one that steps it (as it
    # once was: on the event loop's), each would hold a pool: 2 + 2 threads on
    # 2 CPUs. The load's idle worker would spin on forever, and libgomp would cut
    # the stepping pool's spins to ~1,000 pause loops: its worker asleep within
    # microseconds after every parallel region, idle below.
    args = ["--dtype", "bfloat16", "--kv-cache-gib", "0.1", "--num-threads", "2", "--omp-wait-policy", "active"]
    # The runner's own GOMP_SPINCOUNT, if any, would override the policy's spin: pin it.
    with Servers(executor_args=args, env={"GOMP_SPINCOUNT": "infinite"}) as s, Client(s.public_addr) as client:
        out = client.complete("The capital of France is", max_tokens=4, temperature=0.0, timeout=120)[0]
        assert out.token_ids
        time.sleep(0.2)  # the last step's result is on its way out
        before = cpu_s_by_thread_name(s.executor.pid)
        time.sleep(1.0)  # no step runs: only spinning OpenMP workers use CPU now
        used = {k: v - before.get(k, 0.0) for k, v in cpu_s_by_thread_name(s.executor.pid).items()}
    assert used.get(FORWARD_THREAD_NAME, 0.0) > 0.25, used  # ~1.0 alone on its core; ~0.0 throttled
    assert sum(v for k, v in used.items() if k != FORWARD_THREAD_NAME) < 0.3, used
