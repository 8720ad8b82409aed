"""This machine's memory bandwidth, measured with torch on the threads torch has now.

Two rates, each the median over `rounds` timed passes over tensors too large
for the caches (`stream_bytes`: 4x the last-level cache, at least 256 MiB):

    copy_bandwidth  dst.copy_(src), counted as bytes read + bytes written
                    (STREAM's convention for Copy): the yardstick for
                    attention's K/V read rate (kv_read_bandwidth.py, forward_sweep.py)
    read_bandwidth  src.sum(), bytes read: a pure read stream, as a GEMM's
                    weights or attention's K/V are

On some machines one is higher, on some the other (a copy's counted bytes
omit the write-allocate reads of its destination; a reduction may not issue
loads fast enough to saturate memory), so a lower bound on the time to read
N bytes divides by the faster of the two (`measure`'s floor_bytes_per_s).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

MIB = 1 << 20
MIN_STREAM_BYTES = 256 * MIB


def llc_bytes() -> int:
    """The last-level cache of the whole machine (every instance of the
    highest cache level, once each), from sysfs; 0 where it cannot be read."""
    instances: dict[tuple[int, str], int] = {}
    for index in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            level = int((index / "level").read_text())
            shared = (index / "shared_cpu_list").read_text().strip()
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        instances[(level, shared)] = int(size.rstrip("KMG")) * units.get(size[-1], 1)
    if not instances:
        return 0
    top = max(level for level, _ in instances)
    return sum(size for (level, _), size in instances.items() if level == top)


def stream_bytes() -> int:
    """A tensor size whose passes come from DRAM: 4x the LLC, at least 256 MiB."""
    return max(MIN_STREAM_BYTES, 4 * llc_bytes())


def _median_seconds(op, rounds: int) -> float:
    op()  # first touch and warm-up
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        op()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(rounds: int, nbytes: int = 512 * MIB) -> float:
    """Bytes read + written per second by a copy of an `nbytes` float32 tensor, median of `rounds`."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _median_seconds(lambda: dst.copy_(src), rounds)


def read_bandwidth(rounds: int, nbytes: int = 512 * MIB) -> float:
    """Bytes read per second by a sum over an `nbytes` float32 tensor, median of `rounds`."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    return src.numel() * 4 / _median_seconds(src.sum, rounds)


def measure(rounds: int, nbytes: int = 0) -> dict:
    """Both rates (bytes/s) over `nbytes` (0: stream_bytes()), and the floor's: the faster."""
    nbytes = nbytes or stream_bytes()
    copy, read = copy_bandwidth(rounds, nbytes), read_bandwidth(rounds, nbytes)
    return dict(
        copy_bytes_per_s=copy,
        read_bytes_per_s=read,
        floor_bytes_per_s=max(copy, read),
        tensor_bytes=nbytes,
        llc_bytes=llc_bytes(),
        threads=torch.get_num_threads(),
    )
