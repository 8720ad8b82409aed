"""Which GEMM multiplies each row count of a bfloat16 model's linear layers,
on CPUs with native bf16 arithmetic (AVX512-BF16 or AMX), measured at start-up.

A widened bfloat16 model (weight_packing.widen_bf16) has up to five GEMMs
for one weight (packed_linear.py):

    blocks   the native kernel over BF16 block panels, float32 arithmetic:
             exact products of the bf16 weights and float32 activations
    gguf     the same kernel over the file's Q4_1/Q8_0 blocks, where kept:
             fewer bytes to stream, the file's exact values
    dot      the kernel's VDPBF16PS loop over the BF16 blocks: activations
             rounded to bf16, twice the multiply rate of float32 FMAs
    gguf_dot its VDPBF16PS loop over the file's blocks, where they are Q4_1:
             the file's bytes, a few instructions per weight instead of
             gguf's widening, activations rounded to bf16
    onednn   oneDNN's bf16 GEMM over a second copy of the weight, reordered
             once (vLLM's CPU back end does this); on AMX CPUs its tiles

Which wins depends on the rows (weight-read bound at a few rows, compute
bound at many), the CPU (AVX512-BF16 or AMX, cores, caches, bandwidth) and
the shape, so no table written here would hold on the next machine. So
`calibrate` times each one that exists on random weights of the model's
largest layer shape (gate and up) at CALIBRATION_ROWS, alternated so that a
busy moment of a shared machine hits all of them, and each row count goes
to the fastest; once per kind of file blocks the weights have (the
loader's measure_bf16_routes), on that same shape, so a kind held only by
a weight of another shape (SmolLM2's Q8_0 head) takes routes measured on a
layer-sized weight of its kind. A bf16-activation GEMM (dot, gguf_dot,
onednn) must beat the best float32
one by BF16_MARGIN: rounding the activations costs precision (as torch's
own bf16 models do), which a gain inside the timing noise does not buy.

Timings on a shared machine are noisy, so two measurements can pick
different routes, and routes decide how a token's sums are rounded. So the
first measurement is stored (`stored_or_measured`) in the kernel cache,
keyed by everything it depends on (CPU, kernel build, torch, threads, shape,
candidates), and later starts on the same machine, an executor restarted
after a crash among them, reuse it: two runs of the same workload compute
the same numbers (docs/determinism.md). Deleting the file re-measures.

Before any timing, each bf16-activation candidate's product is checked
against the float32 arithmetic's (`agreeing`), and one that differs by
more than bf16 rounding explains is dropped with an error in the log. The
native VDPBF16PS loops and oneDNN's bf16 kernels run only on the CPUs that
have the instruction, which the machines this code was written on lack; a
compiler or CPU that computes them wrong must cost speed, not answers.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable

import structlog
import torch

from executor_svc import native_build, onednn_linear
from executor_svc.packed_linear import (
    BLOCK_FORMATS,
    BLOCK_K,
    GGUF_DOT_KINDS,
    PackedWeight,
    linear,
    pack_bf16,
    pack_blocks,
)
from shared.private_dir import ensure_private_dir

# Row counts timed: decode batches and prefill chunks fall between them, and
# take the route of the largest one at or below them (2,048: a full prefill
# chunk, so that no route is extrapolated to one). 5 is the first row count
# past the float32 block loop's register tile (FUSED_MAX_ROWS = 4 in
# fused_blocks.h), where that loop slows down (3,072 x 576, cold, AMD EPYC:
# Q8_0 150.6 -> 206.5 us from 4 to 5 rows, Q4_1 177.8 -> 225.6), which
# timing 4 and 8 alone cannot see.
CALIBRATION_ROWS = (1, 2, 4, 5, 8, 16, 32, 64, 128, 256, 512, 2048)
# How much faster (median) a GEMM on bf16-rounded activations must be.
BF16_MARGIN = 1.05
FLOAT32_ARITHMETIC = ("blocks", "gguf")
# The float32 GEMM each bf16-activation one is checked against (`agreeing`):
# the one over the same weight.
SAME_WEIGHT = {"dot": "blocks", "onednn": "blocks", "gguf_dot": "gguf"}
# The most a bf16-activation product may differ from the float32 one, as a
# fraction of its norm. Rounding the activations to bf16 (8 bits) moves a
# product by ~2^-9 of its norm; an operand mis-paired or a lane dropped by
# a wrong build moves it by about the norm itself.
ROUTE_TOLERANCE = 0.02
# The caches' size where machine.cache_bytes cannot tell (no sysfs).
UNKNOWN_CACHE_BYTES = 32 << 20

Gemm = Callable[[torch.Tensor], torch.Tensor]
Routes = tuple[tuple[int, str], ...]
log = structlog.get_logger(__name__)


def _random_gguf_rows(kind: str, out_features: int, in_features: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [out, in / 32, block bytes]: random codes under small float16 scales."""
    block_bytes = BLOCK_FORMATS[kind][1]
    rows = torch.randint(0, 256, (out_features, in_features // BLOCK_K, block_bytes), generator=gen, dtype=torch.uint8)
    scales = 2 if kind == "Q4_1" else 1  # Q4_1: f16 d, f16 m; Q8_0: f16 d
    for i, value in enumerate((0.01, -0.08)[:scales]):
        rows[..., 2 * i : 2 * i + 2] = (
            torch.full(rows.shape[:2], value, dtype=torch.float16).view(torch.uint8).view(*rows.shape[:2], 2)
        )
    return rows


def candidate_names(*, gguf_kind: str | None, dot: bool, onednn: bool) -> list[str]:
    """The GEMMs `candidates` builds, in its order: what a stored measurement's key names."""
    gguf_dot = dot and gguf_kind in GGUF_DOT_KINDS
    return [
        "blocks",
        *(["gguf"] if gguf_kind else []),
        *(["dot"] if dot else []),
        *(["gguf_dot"] if gguf_dot else []),
        *(["onednn"] if onednn else []),
    ]


def winner(median: dict[str, float]) -> str:
    """The GEMM a row count goes to, from each one's median time: the fastest,
    unless it rounds activations to bf16 and beats the best float32-arithmetic
    one by less than BF16_MARGIN. oneDNN must also beat the fastest of the
    others by BF16_MARGIN: a route naming it keeps a second bf16 copy of every
    weight (on an AMD EPYC it tied the dot kernel at 512 rows, 4,858 against
    4,876 us, which would have bought 0.4% for 270 MB)."""
    best = min((n for n in median if n in FLOAT32_ARITHMETIC), key=median.__getitem__)
    fastest = min(median, key=median.__getitem__)
    if fastest == "onednn":
        others = min((n for n in median if n != "onednn"), key=median.__getitem__)
        if median["onednn"] * BF16_MARGIN > median[others]:
            fastest = others
    if fastest not in FLOAT32_ARITHMETIC and median[fastest] * BF16_MARGIN > median[best]:
        return best
    return fastest


def candidates(
    out_features: int,
    in_features: int,
    *,
    gguf_kind: str | None,
    dot: bool,
    onednn: bool,
    native_max_rows: int = 0,
    seed: int = 0,
) -> dict[str, Gemm]:
    """The GEMMs a widened bfloat16 weight of this shape would have, each
    through packed_linear.linear with its route forced, on random weights;
    "blocks" (float32 arithmetic) through the kernel up to `native_max_rows`
    (PackedWeight.native_max_rows) and MKL past them, as the model runs it."""
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).to(torch.bfloat16)
    blocks = pack_bf16(weight)
    packed = {"blocks": PackedWeight(None, blocks, native_max_rows=native_max_rows)}
    if gguf_kind is not None:
        gguf = pack_blocks(gguf_kind, _random_gguf_rows(gguf_kind, out_features, in_features, gen))
        packed["gguf"] = PackedWeight(None, blocks, gguf=gguf, bf16_routes=((1, "gguf"),))
    if dot:
        packed["dot"] = PackedWeight(None, blocks, bf16_routes=((1, "dot"),))
        if gguf_kind in GGUF_DOT_KINDS:
            packed["gguf_dot"] = PackedWeight(None, blocks, gguf=gguf, bf16_routes=((1, "gguf_dot"),))
    if onednn:
        packed["onednn"] = PackedWeight(None, blocks, onednn_linear.pack(weight), bf16_routes=((1, "onednn"),))
    return {name: (lambda x, p=p: linear(x, weight, None, p)) for name, p in packed.items()}


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    """||out - reference|| / ||reference||, in float64; NaN or inf where
    `out` holds a NaN or an infinity, or its shape is wrong."""
    if not isinstance(out, torch.Tensor) or out.shape != reference.shape:
        return float("inf")
    ref = reference.double()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def agreeing(gemms: dict[str, Gemm], in_features: int, rows: tuple[int, ...] = CALIBRATION_ROWS) -> dict[str, Gemm]:
    """`gemms` without the bf16-activation ones whose product, at any of
    `rows`, is further than ROUTE_TOLERANCE from the float32 arithmetic over
    the same weight (SAME_WEIGHT: the BF16 blocks', or the file's blocks'
    for gguf_dot), logged as an error: a wrong kernel build or CPU."""
    gen = torch.Generator().manual_seed(2)
    kept = dict(gemms)
    for count in rows:
        x = torch.randn(count, in_features, generator=gen)
        checked = [n for n in kept if n not in FLOAT32_ARITHMETIC]
        reference = {name: gemms[name](x) for name in {SAME_WEIGHT[n] for n in checked}}
        for name in checked:
            error = relative_error(kept[name](x), reference[SAME_WEIGHT[name]])
            if not error <= ROUTE_TOLERANCE:
                log.error("bf16_linear_route_disagrees", route=name, rows=count, relative_error=error)
                del kept[name]
    return kept


def weights_outgrow_cache(weight_bytes: int, cache_bytes: int | None) -> bool:
    """Whether a model's weights (`weight_bytes`) come from memory at every
    step: more than the CPU's L2 and L3 caches hold (`cache_bytes`,
    machine.cache_bytes; None: UNKNOWN_CACHE_BYTES). Then `calibrate`
    times each GEMM with its weight out of the cache (cache_evictor), as the
    model will run it.

    Timed with its weight hot in cache, as it first was, the BF16 blocks
    beat the file's Q4_1 blocks at 1-2 rows on an AMD EPYC (66.8 against
    71.2 us), while in the model, whose 269 MB of BF16 blocks come from
    memory every step, the Q4_1 blocks (96 MB) made a one-decode step 1.39x
    faster (docs/optimization_log.md)."""
    return weight_bytes > (cache_bytes or UNKNOWN_CACHE_BYTES)


def cache_evictor(cache_bytes: int | None) -> Callable[[], None]:
    """An update of every value of a buffer twice the caches' size (None:
    UNKNOWN_CACHE_BYTES), run on torch's threads: written as well as read, so that
    replacement policies that resist a read-only scan still give up most of
    what they held. Costs that buffer at the first start only (routes are
    stored)."""
    buffer = torch.zeros(2 * (cache_bytes or UNKNOWN_CACHE_BYTES) // 4, dtype=torch.float32)

    def evict() -> None:
        buffer.add_(1.0)

    return evict


def calibrate(
    gemms: dict[str, Gemm],
    in_features: int,
    rows: tuple[int, ...] = CALIBRATION_ROWS,
    reps: int = 5,
    clock: Callable[[], float] = time.perf_counter,
    evict: Callable[[], None] | None = None,
) -> tuple[tuple[tuple[int, str], ...], dict[int, dict[str, float]]]:
    """(routes, times): routes as PackedWeight.bf16_routes, (from_rows, name)
    wherever the winner changes, from rows[0] on; times the median
    microseconds of each GEMM at each row count, for the log, of those
    `agreeing` keeps. Medians of `reps` calls after one warm-up call each
    (oneDNN's primitive cache), each after `evict()` where given
    (cache_evictor), untimed."""
    assert "blocks" in gemms, "the BF16 blocks are the baseline every weight has"
    gemms = agreeing(gemms, in_features, rows)
    median_s = median_times(gemms, in_features, rows, reps, clock, evict)
    routes: list[tuple[int, str]] = []
    for count, median in median_s.items():
        fastest = winner(median)
        if not routes or routes[-1][1] != fastest:
            routes.append((count, fastest))
    return tuple(routes), microseconds(median_s)


def median_times(
    gemms: dict[str, Gemm],
    in_features: int,
    rows: tuple[int, ...],
    reps: int,
    clock: Callable[[], float],
    evict: Callable[[], None] | None = None,
) -> dict[int, dict[str, float]]:
    """The median seconds of each GEMM at each row count (in `rows`' order)
    over `reps` calls after one untimed warm-up call, the GEMMs alternated
    call by call so that a busy moment of a shared machine hits them all;
    `evict()`, where given, runs untimed before each call."""
    gen = torch.Generator().manual_seed(1)
    median_s: dict[int, dict[str, float]] = {}
    for count in rows:
        x = torch.randn(count, in_features, generator=gen)
        runs: dict[str, list[float]] = {name: [] for name in gemms}
        for i in range(reps + 1):
            for name, gemm in gemms.items():
                if evict is not None:
                    evict()
                start = clock()
                gemm(x)
                if i:
                    runs[name].append(clock() - start)
        median_s[count] = {name: sorted(r)[reps // 2] for name, r in runs.items()}
    return median_s


def microseconds(median_s: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    """median_times' seconds as microseconds to 0.1, for the log and the stored file."""
    return {count: {name: round(t * 1e6, 1) for name, t in m.items()} for count, m in median_s.items()}


def machine_key(source: str, **measurement) -> dict:
    """The key a measurement is stored under: what the timing depends on
    beyond `measurement` (the shape, candidates, method and its version):
    the kernel's build (source, flags, CPU), the cores, torch and threads."""
    return dict(
        **measurement,
        kernel=native_build.build_key(source),
        cpus=os.cpu_count(),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
    )


def stored_or_measured(key: dict, measure: Callable[[], tuple[Routes, dict]]) -> tuple[Routes, dict, str]:
    """(routes, times, where from): the routes stored under `key` in the kernel
    cache if a valid file is there ("stored", no times), else `measure()`'s,
    then stored ("measured"). A cache that cannot be used (not private, not
    writable, a damaged file) costs a measurement, never a start. Processes
    starting together (tensor-parallel ranks on one host) take turns under a
    file lock, so one measures, on quiet cores, and the others read its routes."""
    text = json.dumps(key, sort_keys=True)
    name = f"bf16-routes-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    try:
        path = os.path.join(ensure_private_dir(native_build.cache_dir()), name)
        lock = open(f"{path}.lock", "a")  # noqa: SIM115 (held until the routes are stored)
    except OSError as e:
        log.warning("bf16_routes_not_stored", reason=str(e))
        routes, times = measure()
        return routes, times, "measured"
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _stored_or_measured(key, measure, path)


def _stored_or_measured(key: dict, measure: Callable[[], tuple[Routes, dict]], path: str) -> tuple[Routes, dict, str]:
    try:
        with open(path) as f:
            found = json.load(f)
        routes = tuple((int(rows), str(how)) for rows, how in found["routes"])
        if found["key"] == key and routes and all(how in key["candidates"] for _, how in routes):
            return routes, {}, "stored"
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("bf16_routes_file_ignored", path=path, reason=repr(e))
    routes, times = measure()
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump({"key": key, "routes": routes, "median_us": times}, f)
        os.replace(tmp, path)  # atomic: a concurrent start reads the old file or this one
    except OSError as e:
        log.warning("bf16_routes_not_stored", path=path, reason=str(e))
    return routes, times, "measured"
