"""The executor's heap keeps a step's freed activations mapped (executor_svc/heap.py).

Without it, glibc hands the forward thread's freed activations back to the
kernel, and each step faults them in again page by page. The behavioural
test counts minor page faults over repeated identical work on a thread other
than the main one: once the heap has grown to the work's size, there must be
next to none. A served executor's own fault counts are not asserted: from one
start to the next its heap settles after a different number of steps.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from executor_svc import heap
from pagedserve_client import Client
from tests.servers import Servers

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="mallopt and fault counts in /proc are glibc's and Linux's",
)


def transparent_huge_pages_always() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


# A step's worth of activations, allocated and freed on a second thread, again
# and again: 16, 4, 24 and 12 MB of float32, and 48 MB (256 decodes' logits
# of the embedded model are 50 MB), past glibc's 32 MiB ceiling on the mmap
# threshold. Prints each round's minor faults. Under glibc 2.36's defaults
# every round after the first few faults its 24 MB in again (6,145 faults a
# round, 61,450 over the last ten of twenty, before the 48 MB block was
# added); with the threshold fixed at 32 MiB instead of mmap off, the 48 MB
# block alone was mapped and faulted in every round.
THREAD_ROUNDS = """
import json, resource, sys, threading
from executor_svc.heap import keep_freed_memory
keep_freed_memory()
import torch

def rounds(out):
    for _ in range(20):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        xs = [torch.ones(n) for n in (4 << 20, 1 << 20, 6 << 20, 3 << 20, 12 << 20)]
        del xs
        out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

faults = []
t = threading.Thread(target=rounds, args=(faults,))
t.start()
t.join()
print(json.dumps(faults))
"""


def test_settings_are_glibcs_and_all_take():
    applied = subprocess.run(
        [sys.executable, "-c", "from executor_svc.heap import keep_freed_memory; print(keep_freed_memory())"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split("\n")[-2]
    assert applied == str({name: value for name, _, value in heap.SETTINGS})


@pytest.mark.skipif(
    transparent_huge_pages_always(), reason="2 MiB pages fault a heap in a few dozen faults, refaulted or not"
)
def test_a_thread_reusing_its_activations_takes_no_page_faults_once_the_heap_has_grown():
    out = subprocess.run([sys.executable, "-c", THREAD_ROUNDS], capture_output=True, text=True, timeout=120, check=True)
    faults = json.loads(out.stdout.split("\n")[-2])
    assert faults[0] > 4096, faults  # the first round does fault its 104 MB in: the count sees them
    # The heap settles within a few rounds (fragmentation by the interpreter's own
    # small blocks); refaulting the 24 MB block alone would be 6,144 a round.
    assert sum(faults[10:]) < 500, faults


# A 48 MB block (past glibc's 32 MiB ceiling on the mmap threshold)
# allocated and freed on the main thread after torch has started a thread of
# its own, as bench.forward_sweep steps the model; prints each round's minor
# faults. Without the settings the block is mapped and faulted in, 12,289
# pages, every round.
MAIN_ROUNDS = """
import json, resource, sys
import torch
from executor_svc.heap import keep_freed_memory
try:
    keep_freed_memory()
    sys.exit("keep_freed_memory() set the heap up with another thread running")
except RuntimeError:
    pass
if sys.argv[1] == "on":
    keep_freed_memory(steps_on_main_thread=True)
faults = []
for _ in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(12 << 20)
    del x
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""


@pytest.mark.skipif(
    transparent_huge_pages_always(), reason="2 MiB pages fault a heap in a few dozen faults, refaulted or not"
)
def test_a_main_thread_stepping_beside_other_threads_gets_the_heap_and_reuses_its_blocks():
    def faults(setting: str) -> list[int]:
        out = subprocess.run(
            [sys.executable, "-c", MAIN_ROUNDS, setting], capture_output=True, text=True, timeout=120, check=True
        )
        return json.loads(out.stdout.split("\n")[-2])

    assert sum(faults("off")[10:]) > 10 * 12_000  # the count sees the block mapped anew each round
    assert sum(faults("on")[10:]) < 500


# 96 MB in 4 MB blocks, freed on a second thread: under keep_freed_memory's
# thresholds the heap keeps it resident until release_free_memory.
RELEASE = """
import sys, threading
from executor_svc.heap import keep_freed_memory, release_free_memory
keep_freed_memory()
import torch

def rss_kb():
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1])

def churn():
    xs = [torch.ones(1 << 20) for _ in range(24)]
    del xs

t = threading.Thread(target=churn)
t.start()
t.join()
kept = rss_kb()
assert release_free_memory()
print(kept, rss_kb())
"""


def test_release_free_memory_hands_the_heaps_free_memory_back():
    out = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True, timeout=120, check=True)
    kept_kb, released_kb = (int(x) for x in out.stdout.split("\n")[-2].split())
    assert kept_kb - released_kb > 80_000, (kept_kb, released_kb)


def test_the_executor_sets_its_heap_up_before_serving():
    # main() calls keep_freed_memory first thing, which asserts that no other
    # thread has started yet (a thread that allocated keeps its own arena); a
    # call after the forward thread started would have failed the executor.
    with Servers(executor_args=["--kv-cache-gib", "0.1"]) as s, Client(s.public_addr) as client:
        assert client.complete("Hello", max_tokens=1, temperature=0.0, timeout=120)[0].token_ids
        lines = [json.loads(line) for line in s.logs("executor").splitlines() if '"heap_settings"' in line]
    assert len(lines) == 1, lines
    assert {k: lines[0][k] for k, _, _ in heap.SETTINGS} == {name: value for name, _, value in heap.SETTINGS}
