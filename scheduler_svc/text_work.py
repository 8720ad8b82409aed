"""Tokenizer work off the event loop.

The event loop runs every stream, the step loop and the health service, so it
must never spend long on one request. Tokenizing a 4 MB prompt takes seconds;
one such request on the loop stalled every stream and the health service
(issue 19). Large inputs therefore go to a thread pool: `tokenizers` releases
the GIL inside its batch calls (Tokenizer.encode/decode use those for large
inputs), and the pure-Python parts (chat templates, id-to-token lists) yield the
GIL every switch interval, so the loop keeps running. Measured on the 2-core
dev box: encoding 3.5 MB in a thread held the loop at most 137 ms at a time
(encode inline: 3.5 s), which is why threads and not processes.

Small inputs stay inline: below `INLINE_UP_TO` characters (or ids) the work
costs less than the ~0.1 ms thread hand-off.
"""

from __future__ import annotations

import asyncio
import functools
import os
from concurrent.futures import ThreadPoolExecutor

INLINE_UP_TO = 1024


def default_threads() -> int:
    """One per CPU this process may use, at most 8: the work is CPU-bound."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8))


class TextWorkers:
    def __init__(self, threads: int | None = None):
        self._pool = ThreadPoolExecutor(threads or default_threads(), thread_name_prefix="text-work")

    async def run(self, size: int, fn, *args, **kwargs):
        """fn(*args, **kwargs), in a worker thread when `size` (characters or ids) is large."""
        if size <= INLINE_UP_TO:
            return fn(*args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
