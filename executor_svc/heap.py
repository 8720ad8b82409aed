"""The executor's heap: a step's freed activations kept mapped for the next step.

Why: a prefill step allocates and frees tens of megabytes of activations a
layer (a 2,048-token chunk of the embedded model: 25 MB of float32 gate/up
output alone), and glibc gives that memory back to the kernel between uses
when the allocating thread is not the process's main thread. Such a thread
gets an arena of its own, made of heaps of at most 64 MiB that glibc shrinks
with MADV_DONTNEED as they empty, and every allocation above the mmap
threshold is mapped for it and unmapped when freed. The next step then
faults all of it in again, one zeroed 4 KiB page at a time. The executor
runs every step on its forward thread (server.forward_thread): on an AMD EPYC
(Zen 5, 2 cores) a 2,048-token prefill step of the embedded model took
117,000-269,000 minor faults and 0.28-0.65 s of system time there, and
1.09-1.38 s against 0.76-0.89 s for the same step on the main thread, which
took no faults (docs/optimization_log.md, twenty-sixth session).

So before any other thread exists, `keep_freed_memory` sets three of
glibc's malloc parameters (mallopt(3)):

    M_ARENA_MAX 1          every thread allocates from the main arena, whose
                           heap grows and shrinks at its top
    M_MMAP_MAX 0           no block is mapped on its own, whatever its size:
                           all come from the heap (otherwise every block past
                           the mmap threshold, 128 KiB adapting up to glibc's
                           32 MiB ceiling, is mapped when allocated and
                           unmapped when freed)
    M_TRIM_THRESHOLD 1 GiB the heap's top is handed back to the kernel only
                           past that much free memory

With all three, the same step on the forward thread took no faults (each
alone, or the thresholds without one arena, did not get there). The
twenty-sixth session fixed the mmap threshold at 32 MiB instead of
disabling mmap: blocks past it stayed mapped per use, and at 256 decodes
the LM head's 50 MB of logits were, 12,289 faults and 89 ms of system time
in a 194 ms step (docs/optimization_log.md, twenty-seventh session). The cost:
the heap keeps up to the largest step's activations mapped between steps,
memory that step needs again anyway, and the executor's other threads (gRPC's,
the event loop's, the OpenMP and oneDNN workers', with tensor parallelism the
process group's) share the main arena's lock with the forward thread; all
but the forward thread allocate little.

The model's load frees temporaries too (dequantised copies of the weights),
which the heap would keep: 114 MB more resident
after loading the embedded model in bfloat16. So the executor hands the
heap's free memory back once, after the load (`release_free_memory`); its
first steps then fault their activations in once more.

Only glibc has these parameters; elsewhere (musl, macOS) nothing is set and
the log says so.
"""

from __future__ import annotations

import ctypes
import os
import threading

import structlog

log = structlog.get_logger(__name__)

# mallopt(3) parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

SETTINGS = (
    ("arena_max", M_ARENA_MAX, 1),
    ("mmap_max", M_MMAP_MAX, 0),
    ("trim_threshold_bytes", M_TRIM_THRESHOLD, 1 << 30),
)


def keep_freed_memory(steps_on_main_thread: bool = False) -> dict[str, int] | None:
    """Sets SETTINGS with glibc's mallopt; returns them as set, or None where
    this C library has no mallopt. Must run while the main thread is the
    process's only thread: a thread that has allocated already keeps its arena,
    and glibc could hand that arena, not the main one, to the forward thread.
    RuntimeError if another thread (Python's or native, where Linux's /proc
    lists them) is running, unless `steps_on_main_thread`: a process that
    steps the model on its main thread (bench.forward_sweep) allocates from
    the main arena whatever threads exist, and needs only the other two."""
    alone = threading.active_count() == 1 and _os_thread_count() in (None, 1)
    if not (alone or steps_on_main_thread):
        raise RuntimeError("the heap must be set up before any other thread starts")
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        log.info("heap_settings_unavailable", reason="no mallopt in this C library")
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    applied = {}
    for name, param, value in SETTINGS:
        # mallopt returns 1 on success; glibc accepts all three, so 0 is a foreign allocator.
        if mallopt(param, value) != 1:
            log.warning("heap_setting_refused", setting=name, value=value)
            continue
        applied[name] = value
    log.info("heap_settings", **applied)
    return applied


def _os_thread_count() -> int | None:
    """The process's threads, native ones included (Linux); None elsewhere."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def release_free_memory() -> bool:
    """Returns the heap's free memory to the kernel once (glibc's
    malloc_trim(3), every arena, free pages amid the heap too); True where
    that was possible."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim(0)
    return True
