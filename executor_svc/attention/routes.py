"""Which arithmetic the CPU attention kernels use over a bfloat16 KV cache, on
CPUs with native bf16 (AVX512-BF16 or AMX), measured at start-up.

Prefills (`--prefill-attention`):

    native  paged_prefill.c: K/V read in place and widened to float32, both
            matrix products as float32 FMAs (the CPU backend's default)
    sdpa    torch's scaled_dot_product_attention in bfloat16 over each
            request's gathered K/V: queries rounded to bf16, its CPU flash
            kernel multiplies bf16 blocks through oneDNN (AMX tiles where the
            CPU has them), accumulating in float32 but rounding the softmax
            probabilities and the output to bf16
    dot     the kernel's VDPBF16PS path (prefill_dot.h): raw bf16 K pairs and
            interleaved V pairs, queries and probabilities rounded to bf16;
            half the instructions of `native` per product

Decodes (`--decode-attention`):

    widen   paged_decode.c: each bf16 K/V value widened to float32 as read,
            float32 FMAs (the default)
    dot     the same kernel's VDPBF16PS path (decode_dot.h): raw bf16 pairs
            multiplied in place, queries and probabilities rounded to bf16;
            half the instructions per byte of K/V read

Where bf16 multiplies at twice the float32 rate (AVX512-BF16) or far more
(AMX), and the bf16 GEMM routes (bf16_gemm_routes.py) have made the linear
layers that much faster, attention's float32 arithmetic becomes a growing
share of a step. Which one wins depends on the CPU, so each is timed, as
the GEMM routes are: the candidates this machine has on the model's
attention shape, alternated, over a synthetic step (PREFILL_STEP,
DECODE_STEP); the fastest bf16 candidate, which rounds, must beat the
float32 default by BF16_MARGIN. A candidate whose output on that step
differs from the default's by more than bf16 rounding explains
(ROUTE_TOLERANCE) is dropped before timing, with an error in the log, as
the GEMM routes' are: the dot paths run only where the instruction exists.
The result is stored in the kernel cache like theirs (same key
discipline), so an executor restarted on this machine computes the same
numbers.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import structlog
import torch

from executor_svc.attention import native_kernel
from executor_svc.attention.cpu_backend import DECODE_ROUTES, PREFILL_ROUTES, CpuAttentionBackend
from executor_svc.attention.reference import make_batch  # the synthetic step the kernel tests use too
from executor_svc.bf16_gemm_routes import (
    BF16_MARGIN,
    ROUTE_TOLERANCE,
    machine_key,
    relative_error,
    stored_or_measured,
)
from executor_svc.native_build import cpu_flags

# (cached, new) tokens of the timed steps, at the default block size, 16.
# Prefills: prompts of a few hundred tokens, a chunk continuing a longer one,
# and one deep into a long context (SDPA gathers a request's whole context
# every layer; the kernel reads it in place), 1,792 query tokens in all.
PREFILL_STEP = ((0, 512), (0, 256), (256, 768), (3840, 256))
# Decodes: a full batch of contexts from short to long (the kernel's work
# splits by decode), 32 x 576 tokens of K/V on average.
DECODE_STEP = tuple((64 + 32 * i, 1) for i in range(32))


@dataclasses.dataclass(frozen=True)
class _Kind:
    """One choice this module times: its routes and its step."""

    name: str
    routes: tuple[str, ...]  # (the float32 default, the bf16 candidates...)
    step: tuple[tuple[int, int], ...]
    source: str  # the kernel source whose build the stored result depends on


PREFILL = _Kind("prefill", PREFILL_ROUTES, PREFILL_STEP, native_kernel.PREFILL_SOURCE)
DECODE = _Kind("decode", DECODE_ROUTES, DECODE_STEP, native_kernel.SOURCE)
log = structlog.get_logger(__name__)


def calibrate(
    kind: _Kind,
    backends: dict[str, CpuAttentionBackend],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    reps: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[str, dict[str, float]]:
    """(route, median microseconds of each backend): one step of kind.step on
    a bfloat16 cache, float32 queries (a widened model's), `reps` timed calls
    each after a warm-up, alternated, of the backends whose warm-up output
    agrees with the default's within ROUTE_TOLERANCE."""
    default, backends = kind.routes[0], dict(backends)
    assert default in backends and set(backends) <= set(kind.routes), f"backends {sorted(backends)}"
    batch = make_batch(
        list(kind.step),
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
    reference = backends[default].forward(query, batch.k_cache, batch.v_cache, metas[default], scale)
    for name in [n for n in backends if n != default]:
        error = relative_error(
            backends[name].forward(query, batch.k_cache, batch.v_cache, metas[name], scale), reference
        )
        if not error <= ROUTE_TOLERANCE:
            log.error(f"{kind.name}_attention_route_disagrees", route=name, relative_error=error)
            del backends[name], runs[name]
    if len(backends) == 1:
        return default, {}
    for i in range(reps + 1):
        for name, backend in backends.items():
            start = clock()
            backend.forward(query, batch.k_cache, batch.v_cache, metas[name], scale)
            if i:
                runs[name].append(clock() - start)
    median = {name: sorted(r)[reps // 2] for name, r in runs.items()}
    best = min((name for name in backends if name != default), key=median.__getitem__)
    route = best if median[best] * BF16_MARGIN < median[default] else default
    return route, {name: round(t * 1e6, 1) for name, t in median.items()}


def _backend(kind: _Kind, route: str) -> CpuAttentionBackend:
    decode, prefill = native_kernel.load(), native_kernel.load_prefill()
    if kind is PREFILL:
        return CpuAttentionBackend(decode, prefill, prefill_route=route)
    return CpuAttentionBackend(decode, prefill, decode_route=route)


def measure(kind: _Kind, candidates: tuple[str, ...], num_heads: int, num_kv_heads: int, head_dim: int) -> str:
    """The route among the float32 default and `candidates` for this model's
    attention shape on this machine: stored in the kernel cache by the first
    start, measured then; logged."""
    routes = (kind.routes[0], *candidates)
    key = machine_key(
        kind.source,
        version=3,  # of this key and of calibrate's method
        kind=kind.name,
        shape=[num_heads, num_kv_heads, head_dim],
        step=[list(p) for p in kind.step],
        candidates=list(routes),
        margin=BF16_MARGIN,
    )

    def timed():
        backends = {name: _backend(kind, name) for name in routes}
        route, times = calibrate(kind, backends, num_heads, num_kv_heads, head_dim)
        return ((1, route),), {"1": times}

    stored, times_us, source = stored_or_measured(key, timed)
    route = stored[0][1]
    log.info(f"{kind.name}_attention_timed", route=route, source=source, median_us=times_us.get("1", {}))
    return route


def _choose(
    kind: _Kind, option: str, backend, kv_dtype, model_dtype, available: Callable[[], tuple[str, ...] | str], shape
) -> tuple[str, str]:
    """(route, why) for one kind: the option as given, the float32 default
    where the choice cannot matter or no bf16 candidate is `available()` (it
    returns the candidates, or why there are none; asked last, since it may
    build a kernel), or measured among them."""
    default = kind.routes[0]
    if kv_dtype != torch.bfloat16:
        return default, f"{str(kv_dtype).removeprefix('torch.')} cache"
    if option != "auto":
        return option, "option"
    if backend.batch_invariant:
        return default, "deterministic"
    if model_dtype != torch.bfloat16:  # a float32 model asked for float32 arithmetic over its bf16 cache
        return default, "float32 model"
    candidates = available()
    if isinstance(candidates, str):
        return default, candidates
    return measure(kind, candidates, *shape), "timed"


def decode_dot_build_needed(
    decode_option: str, backend_name: str, kv_dtype: torch.dtype, model_dtype: torch.dtype, deterministic: bool
) -> bool:
    """Whether `apply` will load the decode kernel's dot build, which doubles
    its compile time (~50 s): an explicit dot over a bf16 cache, or auto
    where `_choose` times the dot route (a bfloat16 model over a bf16 cache,
    outside --deterministic, on a CPU with AVX512-BF16), on the cpu backend.
    Known before the model loads, so that a first start compiles it beside
    the other kernels (native_build.prebuild) rather than after them. A
    wrong answer costs time only: an extra compile, or a later one."""
    if backend_name != "cpu" or kv_dtype != torch.bfloat16:
        return False
    if decode_option != "auto":
        return decode_option == "dot"
    return not deterministic and model_dtype == torch.bfloat16 and "avx512_bf16" in cpu_flags()


def apply(
    prefill_option: str,
    decode_option: str,
    backend,
    kv_dtype: torch.dtype,
    model_dtype: torch.dtype,
    fast_bf16: bool,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """--prefill-attention and --decode-attention for this executor's
    attention backend: "auto" measures (`measure`) where it can matter: a
    CpuAttentionBackend over a bfloat16 cache of a bfloat16 model (whose own
    arithmetic rounds to bf16; a float32 model keeps float32 arithmetic over
    its cache), not batch-invariant, on a CPU with native bf16 (`fast_bf16`;
    for decodes, the kernel's VDPBF16PS path for this shape). Elsewhere the
    bf16 candidate is emulated and slower, and the float32 arithmetic stays
    (and the decode kernel's dot build is never compiled). An explicit "dot"
    on a CPU without AVX512-BF16 runs the emulation (a test of the path, not
    a speed-up). An explicit route where the cpu backend is not in use (no
    kernel built, or a device resolved to CUDA) is refused, not ignored."""
    if not isinstance(backend, CpuAttentionBackend):
        for flag, option in (("--prefill-attention", prefill_option), ("--decode-attention", decode_option)):
            if option != "auto":  # the config refuses it beside torch/triton/CUDA; here auto chose them
                raise ValueError(f"{flag} {option} needs the cpu attention backend; this executor runs {backend.name}")
        return
    shape = (num_heads, num_kv_heads, head_dim)

    def prefill_available() -> tuple[str, ...] | str:
        if not fast_bf16:
            return "no native bf16"
        if native_kernel.load_prefill() is None:
            return "no prefill kernel (SDPA for every prefill)"
        dot = native_kernel.load_prefill().dot_native and native_kernel.prefill_dot_supported(*shape)
        return ("sdpa", "dot") if dot else ("sdpa",)

    def decode_available() -> tuple[str, ...] | str:
        if not native_kernel.dot_native():
            return "no AVX512-BF16"
        return ("dot",) if native_kernel.dot_supported(*shape) else "no bf16 dot instance for this shape"

    for flag, option, supported in (
        ("--prefill-attention", prefill_option, native_kernel.prefill_dot_supported),
        ("--decode-attention", decode_option, native_kernel.dot_supported),
    ):
        # Asked only for an explicit dot: answering builds the kernel's dot variant.
        if option == "dot" and kv_dtype == torch.bfloat16 and not supported(*shape):
            raise ValueError(
                f"{flag} dot: the kernel has no bf16 dot path for {num_heads} query heads over {num_kv_heads} KV "
                f"heads of {head_dim} (it needs AVX-512BW, head_dim 64 or 128, at most 8 query heads per KV head)"
            )
    route, why = _choose(PREFILL, prefill_option, backend, kv_dtype, model_dtype, prefill_available, shape)
    backend.use_prefill_route(route)
    emulated = route == "dot" and not native_kernel.load_prefill().dot_native
    log.info("prefill_attention_route", route=route, why=why, **({"emulated": True} if emulated else {}))

    route, why = _choose(DECODE, decode_option, backend, kv_dtype, model_dtype, decode_available, shape)
    backend.use_decode_route(route)
    emulated = route == "dot" and not native_kernel.dot_native()
    log.info("decode_attention_route", route=route, why=why, **({"emulated": True} if emulated else {}))
