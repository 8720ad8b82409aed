"""Up to how many rows the native kernel's float32 arithmetic multiplies a
linear layer before MKL takes over, measured at start-up.

The packed kernel (packed_linear.py) has a float32 GEMM of its own for
float32 panels and for the BF16 blocks of a widened bfloat16 model. Past a
row count fixed in packed_linear (PACKED_MAX_ROWS, BF16_MAX_ROWS), prefill
chunks went to MKL (F.linear), measured as fast or faster there on the Xeons
and the Zen 4 EPYC of earlier sessions. That does not hold on every CPU: on
an AMD EPYC Zen 5 MKL's float32 GEMM runs AVX2 kernels (`sgemm_kernel_0_zen`)
at ~205 GFLOP/s on two cores, while the kernel's AVX-512 loop runs the same
2,048-row prefill GEMMs at ~480 (docs/optimization_log.md). Which is faster
is the CPU's (vendor, vector width, MKL's dispatch), so it is measured here
rather than written down, as bf16_gemm_routes.py measures the bf16 routes.

`calibrate` times both on random weights of the model's largest layer
shape (gate and up) at CALIBRATION_ROWS, alternated so that a busy moment
of a shared machine hits both, each after one untimed warm-up call. The
kernel keeps every row count up to the last timed one before the first
where it is not NATIVE_MARGIN faster than MKL; winning at every timed
count, it keeps them all (the kernel works through rows a chunk of MC at a
time, so its rate does not fall with more rows). Where MKL wins at the
first timed count, the fixed defaults stay.

Both are float32 arithmetic, summed in different orders, so the choice
moves results by float32 rounding; it is stored in the kernel cache like
the bf16 routes (bf16_gemm_routes.stored_or_measured), so later starts on
the same machine compute the same numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from executor_svc.bf16_gemm_routes import median_times, microseconds
from executor_svc.packed_linear import INT8_MAX_ROWS, PackedWeight, linear, pack, pack_bf16

# Prefill chunk sizes past the panels' fixed limit (256 rows), up to a full
# 2,048-token chunk. 384 first: two of the kernel's 256-row chunks split
# unevenly between threads there, and a Xeon's kernel ran 0.85x MKL
# (docs/optimization_log.md).
CALIBRATION_ROWS = (384, 512, 1024, 2048)
# How much faster (median) the kernel must be to take rows from MKL: both
# are float32, so this only keeps a tie inside the timing noise with the default.
NATIVE_MARGIN = 1.05
# native_max_rows where the kernel won at every timed row count.
UNBOUNDED = INT8_MAX_ROWS
KINDS = ("panels", "bf16")  # float32 panels of a float32 model; BF16 blocks of a widened bfloat16 one
# Environment variables that change which kernels MKL dispatches to.
MKL_DISPATCH_ENV = ("MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE", "MKL_CBWR")

Gemm = Callable[[torch.Tensor], torch.Tensor]


def candidates(out_features: int, in_features: int, kind: str, seed: int = 0) -> dict[str, Gemm]:
    """{"native": the kernel at every row count, "torch": MKL} over one random
    weight, each through packed_linear.linear as the model calls it (a
    bfloat16 weight widened per call for MKL, as the "torch" route does)."""
    assert kind in KINDS, f"unknown kind {kind!r}"
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    if kind == "panels":
        native = PackedWeight(pack(weight), native_max_rows=UNBOUNDED)
    else:
        weight = weight.to(torch.bfloat16)
        native = PackedWeight(None, pack_bf16(weight), native_max_rows=UNBOUNDED)
    return {"native": lambda x: linear(x, weight, None, native), "torch": lambda x: linear(x, weight, None, None)}


def native_max_rows(median_s: dict[int, dict[str, float]]) -> int:
    """PackedWeight.native_max_rows from each row count's median times: 0 (the
    default) where MKL is as fast at the first count, else the last count
    before the first where it is, else UNBOUNDED."""
    counts = sorted(median_s)
    for i, count in enumerate(counts):
        t = median_s[count]
        if t["native"] * NATIVE_MARGIN > t["torch"]:
            return counts[i - 1] if i else 0
    return UNBOUNDED if counts else 0


def calibrate(
    gemms: dict[str, Gemm],
    in_features: int,
    rows: tuple[int, ...] = CALIBRATION_ROWS,
    reps: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[int, dict[int, dict[str, float]]]:
    """(native_max_rows, median microseconds of each GEMM at each row count)."""
    median_s = median_times(gemms, in_features, rows, reps, clock)
    return native_max_rows(median_s), microseconds(median_s)
