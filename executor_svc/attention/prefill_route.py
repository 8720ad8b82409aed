"""Which kernel runs prefill attention over a bfloat16 KV cache, on CPUs with
native bf16 arithmetic (AVX512-BF16 or AMX), measured at start-up.

    native  paged_prefill.c: K/V read in place and widened to float32, both
            matrix products as float32 FMAs (the CPU backend's default)
    sdpa    torch's scaled_dot_product_attention in bfloat16 over each
            request's gathered K/V: queries rounded to bf16, its CPU flash
            kernel multiplies bf16 blocks through oneDNN (AMX tiles where the
            CPU has them), accumulating in float32 but rounding the softmax
            probabilities and the output to bf16

Where bf16 multiplies at twice the float32 rate (AVX512-BF16) or far more
(AMX), and the bf16 GEMM routes (bf16_gemm_routes.py) have made the linear
layers of a prefill that much faster, the float32 FMAs of the native kernel
become a growing share of a prefill step. Which one wins depends on the
CPU, so it is timed, as the GEMM routes are: both kernels on the model's
attention shape, alternated, over a few prefills of CALIBRATION_PREFILLS;
sdpa, which rounds the queries to bf16, must win by BF16_MARGIN. The result
is stored in the kernel cache like theirs (same key discipline), so an
executor restarted on this machine computes the same numbers.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import structlog
import torch

from executor_svc.attention import native_kernel
from executor_svc.attention.cpu_backend import PREFILL_ROUTES, CpuAttentionBackend
from executor_svc.attention.reference import make_batch  # the synthetic step the kernel tests use too
from executor_svc.bf16_gemm_routes import BF16_MARGIN, machine_key, stored_or_measured

# (cached, new) tokens of the timed step's prefills: prompts of a few hundred
# tokens, a chunk continuing a longer one, and one deep into a long context
# (SDPA gathers a request's whole context every layer; the kernel reads it in
# place), 1,792 query tokens in all. Timed at the default block size, 16.
CALIBRATION_PREFILLS = ((0, 512), (0, 256), (256, 768), (3840, 256))
log = structlog.get_logger(__name__)


def calibrate(
    backends: dict[str, CpuAttentionBackend],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    reps: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[str, dict[str, float]]:
    """(route, median microseconds of each backend): one step of
    CALIBRATION_PREFILLS on a bfloat16 cache, float32 queries (a widened
    model's), `reps` timed calls each after a warm-up, alternated."""
    assert set(backends) == set(PREFILL_ROUTES), f"backends {sorted(backends)}"
    batch = make_batch(
        list(CALIBRATION_PREFILLS),
        block_size=16,
        num_kv_heads=num_kv_heads,
        group=num_heads // num_kv_heads,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        seed=0,
    )
    query = batch.query.float()
    scale = head_dim**-0.5
    runs: dict[str, list[float]] = {name: [] for name in backends}
    metas = {}
    for name, backend in backends.items():
        metas[name] = dataclasses.replace(batch.meta, extra={})
        backend.write_kv(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, metas[name])
        backend.prepare(metas[name])
    for i in range(reps + 1):
        for name, backend in backends.items():
            start = clock()
            backend.forward(query, batch.k_cache, batch.v_cache, metas[name], scale)
            if i:
                runs[name].append(clock() - start)
    median = {name: sorted(r)[reps // 2] for name, r in runs.items()}
    route = "sdpa" if median["sdpa"] * BF16_MARGIN < median["native"] else "native"
    return route, {name: round(t * 1e6, 1) for name, t in median.items()}


def measure(num_heads: int, num_kv_heads: int, head_dim: int) -> str:
    """The route for this model's attention shape on this machine: stored in
    the kernel cache by the first start, measured then; logged."""
    key = machine_key(
        native_kernel.PREFILL_SOURCE,
        version=1,  # of this key and of calibrate's method
        shape=[num_heads, num_kv_heads, head_dim],
        prefills=[list(p) for p in CALIBRATION_PREFILLS],
        candidates=list(PREFILL_ROUTES),
        margin=BF16_MARGIN,
    )

    def timed():
        decode, prefill = native_kernel.load(), native_kernel.load_prefill()
        backends = {name: CpuAttentionBackend(decode, prefill, prefill_route=name) for name in PREFILL_ROUTES}
        route, times = calibrate(backends, num_heads, num_kv_heads, head_dim)
        return ((1, route),), {"1": times}

    routes, times_us, source = stored_or_measured(key, timed)
    route = routes[0][1]
    log.info("prefill_attention_timed", route=route, source=source, median_us=times_us.get("1", {}))
    return route


def apply(
    option: str,
    backend,
    kv_dtype: torch.dtype,
    fast_bf16: bool,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """--prefill-attention for this executor's attention backend: "native" and
    "sdpa" as given; "auto" measures (`measure`) where it can matter: a
    CpuAttentionBackend with its prefill kernel, over a bfloat16 cache, on a
    CPU with native bf16 (`fast_bf16`), not batch-invariant. Elsewhere bf16
    SDPA is emulated and slower, and the kernel stays."""
    if not isinstance(backend, CpuAttentionBackend):
        return
    route, why = option, "option"
    if kv_dtype != torch.bfloat16:
        route, why = "native", "float32 cache"
    elif option == "auto":
        if backend.batch_invariant:
            route, why = "native", "deterministic"
        elif not fast_bf16:
            route, why = "native", "no native bf16"
        elif native_kernel.load_prefill() is None:
            route, why = "native", "no prefill kernel (SDPA for every prefill)"
        else:
            route, why = measure(num_heads, num_kv_heads, head_dim), "timed"
    backend.use_prefill_route(route)
    log.info("prefill_attention_route", route=route, why=why)
