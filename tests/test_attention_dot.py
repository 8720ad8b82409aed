"""The attention kernels' bf16 dot-product paths (route "dot": decodes in
attention/native/decode_dot.h, prefills in prefill_dot.h): raw bfloat16 K/V
pairs through VDPBF16PS, or its emulation in AVX-512F on CPUs without
AVX512-BF16, which is what runs here unless the CPU has the instruction.
Checked against float64 attention over the same bf16-rounded queries: the
only further error is the softmax probabilities' rounding to bf16
(relative 2^-9 each) and float32 sums."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from attention_utils import run_step

from executor_svc.attention import native_kernel
from executor_svc.attention.cpu_backend import CpuAttentionBackend
from executor_svc.attention.reference import make_batch
from executor_svc.native_build import load_library

pytestmark = pytest.mark.skipif(
    native_kernel.load() is None or not native_kernel.dot_supported(2, 1, 64),
    reason="needs the AVX-512 decode kernel built with AVX-512BW",
)
# Contexts of 1 token, odd and even chunk ends, a block boundary inside a
# chunk (block size 8 and 16), and a few chunks long.
SHAPES = [(0, 1), (14, 1), (15, 1), (16, 1), (40, 1), (100, 1), (257, 1)]


def backend(route: str, dot_native: bool | None = None, prefill: str = "native") -> CpuAttentionBackend:
    return CpuAttentionBackend(
        native_kernel.load(),
        native_kernel.load_prefill(),
        decode_route=route,
        prefill_route=prefill,
        dot_native=dot_native,
    )


def batch_for(
    head_dim: int, group: int, block_size: int = 16, float_queries: bool = True, seed: int = 0, dtype=torch.bfloat16
):
    batch = make_batch(
        SHAPES, block_size=block_size, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype, seed=seed
    )
    if float_queries:  # a widened bf16 model's: float32 queries and outputs, not bf16-valued
        query = torch.randn(batch.query.shape, generator=torch.Generator().manual_seed(seed + 1)) * 2
        batch = dataclasses.replace(batch, query=query)
    return batch


def fresh(batch):
    """The batch with its own caches and an unprepared step, so routes run side by side."""
    return dataclasses.replace(
        batch,
        meta=dataclasses.replace(batch.meta, extra={}),
        k_cache=batch.k_cache.clone(),
        v_cache=batch.v_cache.clone(),
    )


def decode(route: str, batch, **kw) -> torch.Tensor:
    return run_step(backend(route, **kw), fresh(batch))


def rounded_query_reference(batch) -> torch.Tensor:
    """float64 attention with the queries rounded to bfloat16, as the dot path rounds them."""
    return dataclasses.replace(batch, query=batch.query.to(torch.bfloat16).float()).expected(torch.float64)


@pytest.mark.parametrize("head_dim,group", [(64, 1), (64, 3), (128, 2), (128, 8)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_dot_decodes_are_attention_within_the_probabilities_rounding(head_dim, group, block_size):
    """A weight w_j rounded to bf16 moves the output by at most 2^-8 w_j |v_j|
    (2^-9 for the weight, the same again for its share of the normaliser),
    so |error| <= 2^-8 max|V|, plus float32 rounding. The widening route
    stays within float32 rounding of the unrounded queries' result."""
    batch = batch_for(head_dim, group, block_size, seed=head_dim + group + block_size)
    dot, widen = decode("dot", batch), decode("widen", batch)
    vmax = max(v.abs().max().item() for v in batch.values)
    err = (dot.double() - rounded_query_reference(batch)).abs().max().item()
    assert err <= 2.0**-8 * vmax + 1e-5, f"{err} against a bound of {2.0**-8 * vmax}"
    assert (widen.double() - batch.expected(torch.float64)).abs().max().item() < 1e-4
    assert not torch.equal(dot, widen), "the bf16 rounding should show"


def with_keys_scaled(batch, factor):
    """The batch with each request's key at position t multiplied by factor(t, seq_len),
    in its cache slots and in the reference alike."""
    k_cache = batch.k_cache.clone()
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    block_size = k_cache.shape[1]
    loc = batch.meta.query_start_loc.tolist()
    keys, new_keys = [], []
    for i, k in enumerate(batch.keys):
        n = k.shape[0]
        pos = torch.arange(n)
        slots = batch.meta.block_tables[i].long()[pos // block_size] * block_size + pos % block_size
        scaled = (k.double() * torch.tensor([factor(t, n) for t in range(n)], dtype=torch.float64)[:, None, None]).to(
            k.dtype
        )
        cached = n - (loc[i + 1] - loc[i])
        k_flat[slots[:cached]] = scaled[:cached]
        keys.append(scaled)
        new_keys.append(scaled[cached:])
    return dataclasses.replace(batch, k_cache=k_cache, keys=keys, new_key=torch.cat(new_keys))


RISING = lambda t, n: 1 + 0.1 * t  # noqa: E731 - the running max climbs chunk after chunk
FALLING = lambda t, n: 1 + 0.1 * (n - 1 - t)  # noqa: E731 - the first chunk holds the maximum
SPIKE = lambda t, n: 40.0 if t == (2 * n) // 3 else 1.0  # noqa: E731 - one late key dominates


@pytest.mark.parametrize("factor", [RISING, FALLING, SPIKE], ids=["rising", "falling", "spike"])
def test_dot_decodes_rescale_when_a_later_chunk_scores_higher(factor):
    """The dot path keeps a running max per head and rescales its sums only
    when a chunk's score exceeds it by more than a slack (decode_dot.h):
    scores that climb across chunks, that peak in the first chunk, or that
    spike once late must all come out as attention within the rounding bound."""
    batch = with_keys_scaled(batch_for(64, 3, seed=21), factor)
    vmax = max(v.abs().max().item() for v in batch.values)
    err = (decode("dot", batch).double() - rounded_query_reference(batch)).abs().max().item()
    assert err <= 2.0**-8 * vmax + 1e-5, f"{err} against a bound of {2.0**-8 * vmax}"


@pytest.mark.parametrize("position", [3, 5, 19])
def test_a_nan_key_makes_its_requests_outputs_nan(position):
    """A NaN score must not become the running max (lanes 3 and 19 are where
    a horizontal max returns it): every head of a request whose history holds
    the NaN key comes out NaN, as exact attention's does, and every other
    request is unaffected."""
    batch = with_keys_scaled(batch_for(64, 3, seed=23), lambda t, n: float("nan") if t == position else 1.0)
    out, ref = decode("dot", batch).double(), rounded_query_reference(batch)
    assert ref.isnan().any() and not ref.isnan().all(), "the batch must hold requests on both sides"
    assert torch.equal(out.isnan(), ref.isnan())
    vmax = max(v.abs().max().item() for v in batch.values)
    fine = ~ref.isnan()
    assert (out[fine] - ref[fine]).abs().max().item() <= 2.0**-8 * vmax + 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("position", [3, 5, 16, 19])
def test_the_widening_route_makes_a_nan_keys_requests_outputs_nan(position, dtype):
    """The float32-arithmetic kernel (decode_heads) takes each chunk's max
    horizontally: a NaN score there must neither become the running max nor
    count as a zero weight (its exp clamped away). Every head of a request
    whose history holds the NaN key comes out NaN, as exact attention's does,
    and every other request stays within float32 rounding of the reference."""
    batch = batch_for(64, 3, seed=23, dtype=dtype)
    batch = with_keys_scaled(batch, lambda t, n: float("nan") if t == position else 1.0)
    out, ref = decode("widen", batch).double(), batch.expected(torch.float64)
    assert ref.isnan().any() and not ref.isnan().all(), "the batch must hold requests on both sides"
    assert torch.equal(out.isnan(), ref.isnan())
    fine = ~ref.isnan()
    torch.testing.assert_close(out[fine], ref[fine], rtol=1e-4, atol=1e-4)


def test_the_dims_come_back_in_order():
    """V interleaved two tokens at a time and put back once: a cache whose
    every V row is its dims' indices must give those indices back exactly
    (every weight times the same row sums to it, whatever the rounding)."""
    batch = batch_for(128, 3)
    index = torch.arange(128, dtype=torch.float32).to(torch.bfloat16)  # 0..128 are exact in bf16
    batch.v_cache[:] = index
    values = [torch.zeros_like(v) + index for v in batch.values]
    batch = dataclasses.replace(batch, values=values, new_value=torch.zeros_like(batch.new_value) + index)
    out = decode("dot", batch)
    torch.testing.assert_close(out, index.float().expand_as(out), rtol=2.0**-8, atol=0)


def test_bf16_queries_and_outputs_match_the_float32_path_rounded():
    """A bfloat16 model's queries and outputs go in and out as they are: the
    float32 path over the same (bf16-valued) queries, rounded after."""
    batch = batch_for(64, 3, float_queries=False, seed=5)
    out = decode("dot", batch)
    assert out.dtype == torch.bfloat16
    widened = decode("dot", dataclasses.replace(batch, query=batch.query.float()))
    assert torch.equal(out, widened.to(torch.bfloat16))


def test_work_splits_give_the_same_bits():
    """Seven decodes on one thread are split by decode (all KV heads in one
    item), on four threads by (decode, KV head): each head's arithmetic is
    the same either way."""
    batch = batch_for(64, 3, seed=9)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 4):
            torch.set_num_threads(threads)
            outs.append(decode("dot", batch))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


def test_the_dot_path_is_refused_where_it_has_no_instance():
    """head_dim 32 (no fast path) and VDPBF16PS asked for on a CPU without
    it: a clear error, never the widening arithmetic under the dot route's
    name. A float32 cache has no bf16 to multiply: the route leaves it to the
    float32 kernel."""
    small = make_batch([(20, 1)], block_size=16, num_kv_heads=1, group=2, head_dim=32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="no bf16 dot path for 2 query heads over 1 KV heads of 32"):
        run_step(backend("dot"), small)
    if not native_kernel.dot_native():
        with pytest.raises(RuntimeError, match="no bf16 dot path"):
            decode("dot", batch_for(64, 3), dot_native=True)
    f32 = make_batch([(20, 1)], block_size=16, num_kv_heads=2, group=3, head_dim=64, dtype=torch.float32)
    assert torch.equal(run_step(backend("dot"), f32), run_step(backend("widen"), f32))  # no bf16 to multiply


def test_only_the_dot_build_has_the_dot_instances():
    """The default build (what every start compiles) leaves them out: they
    double its compile time; the portable build has no fast path for them."""
    dot_built = {
        flags: load_library(native_kernel.SOURCE, flags).paged_decode_dot_built()
        for flags in ((), ("-DPAGED_DECODE_DOT",), ("-DPAGED_DECODE_GENERIC", "-DPAGED_DECODE_DOT"))
    }
    assert list(dot_built.values()) == [0, 1, 0]
    assert backend("widen")._kernel is native_kernel.load()
    assert backend("dot")._kernel is native_kernel.load(dot=True)


@pytest.mark.skipif(not native_kernel.dot_native(), reason="needs AVX512-BF16")
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 8)])
def test_vdpbf16ps_agrees_with_its_emulation(head_dim, group):
    """The instruction against its emulated arithmetic: they may differ where
    the instruction flushes denormals (tiny probabilities) or rounds a lane's
    pair of products otherwise (Intel defines two FMAs; other cores may
    differ), and a score one ulp off may round its probability to the next
    bf16: each within the route's own bound, 2^-8 max|V| from the float64
    reference, which a wrong pairing or order of dims would exceed."""
    batch = batch_for(head_dim, group, seed=11)
    native, emulated = decode("dot", batch, dot_native=True), decode("dot", batch, dot_native=False)
    vmax = max(v.abs().max().item() for v in batch.values)
    assert (native.double() - emulated.double()).abs().max().item() <= 2.0**-7 * vmax
    err = (native.double() - rounded_query_reference(batch)).abs().max().item()
    assert err <= 2.0**-8 * vmax + 1e-5


# Prefills: fresh prompts, a chunk continuing a cached one (its first rows
# near the diagonal of an earlier chunk), lengths that end mid-chunk, and
# decodes beside them (the decode route's, "widen" here).
PREFILL_SHAPES = [(0, 37), (0, 70), (40, 29), (0, 1), (250, 17), (55, 1)]


def prefill_batch(head_dim: int, group: int, block_size: int = 16, seed: int = 0):
    batch = make_batch(
        PREFILL_SHAPES, block_size=block_size, num_kv_heads=2, group=group, head_dim=head_dim, dtype=torch.bfloat16,
        seed=seed,
    )  # fmt: skip
    query = torch.randn(batch.query.shape, generator=torch.Generator().manual_seed(seed + 1)) * 2
    return dataclasses.replace(batch, query=query)


def prefill(route: str, batch, **kw) -> torch.Tensor:
    return run_step(backend("widen", prefill=route, **kw), fresh(batch))


def prefill_rows(batch) -> torch.Tensor:
    starts = batch.meta.query_start_loc.tolist()
    return torch.tensor(
        [t for i, n in enumerate(batch.meta.query_lens_cpu) if n > 1 for t in range(starts[i], starts[i + 1])]
    )


@pytest.mark.parametrize("head_dim,group", [(64, 1), (64, 3), (128, 2), (128, 8)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_dot_prefills_are_attention_within_the_probabilities_rounding(head_dim, group, block_size):
    """As the decode path's bound: |error| <= 2^-8 max|V| against float64 over
    the rounded queries; the kernel's float32 route stays within float32
    rounding of the unrounded queries' result; decodes are untouched."""
    batch = prefill_batch(head_dim, group, block_size, seed=head_dim + group + block_size)
    dot, native = prefill("dot", batch), prefill("native", batch)
    rows = prefill_rows(batch)
    vmax = max(v.abs().max().item() for v in batch.values)
    err = (dot.double() - rounded_query_reference(batch))[rows].abs().max().item()
    assert err <= 2.0**-8 * vmax + 1e-5, f"{err} against a bound of {2.0**-8 * vmax}"
    assert (native.double() - batch.expected(torch.float64)).abs().max().item() < 1e-4
    assert not torch.equal(dot[rows], native[rows]), "the bf16 rounding should show"
    others = torch.tensor([t for t in range(batch.query.shape[0]) if t not in set(rows.tolist())])
    assert torch.equal(dot[others], native[others])


def test_prefill_dims_come_back_in_order():
    """V rows that are their dims' indices give the indices back exactly (the
    interleaved V pairs and their un-permute)."""
    batch = prefill_batch(128, 3, seed=4)
    index = torch.arange(128, dtype=torch.float32).to(torch.bfloat16)
    batch.v_cache[:] = index
    values = [torch.zeros_like(v) + index for v in batch.values]
    batch = dataclasses.replace(batch, values=values, new_value=torch.zeros_like(batch.new_value) + index)
    out = prefill("dot", batch)
    torch.testing.assert_close(out, index.float().expand_as(out), rtol=2.0**-8, atol=0)


def test_the_prefill_dot_path_is_refused_where_it_has_no_instance():
    """head_dim 32 has no prefill instance at all (the float32 route falls
    back to SDPA there; the dot route must not), and VDPBF16PS asked for on a
    CPU without it. A float32 cache keeps the float32 kernel."""
    small = make_batch([(0, 20)], block_size=16, num_kv_heads=1, group=2, head_dim=32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="prefill route 'dot': the prefill kernel has no bf16 dot path"):
        run_step(backend("widen", prefill="dot"), small)
    if not native_kernel.dot_native():
        with pytest.raises(RuntimeError, match="no bf16 dot path"):
            prefill("dot", prefill_batch(64, 3), dot_native=True)
    f32 = make_batch([(10, 30)], block_size=16, num_kv_heads=2, group=3, head_dim=64, dtype=torch.float32)
    assert torch.equal(run_step(backend("widen", prefill="dot"), f32), run_step(backend("widen"), f32))


@pytest.mark.parametrize(
    "route,dtype", [("native", torch.float32), ("native", torch.bfloat16), ("dot", torch.bfloat16)]
)
@pytest.mark.parametrize("position", [3, 7, 18, 60])
def test_a_nan_key_makes_the_prefill_rows_that_attend_to_it_nan(route, dtype, position):
    """The prefill kernels weigh each key by exp512(score - running max): a NaN
    key's weight must come out NaN, not as exp512's stand-in for zero, since
    the running max, taken lane by lane in four chains, may or may not keep
    it. Every query row at or past the NaN key (in the cache, or in the
    chunk itself) comes out NaN, as exact attention's does; rows before it,
    and other requests, stay within their usual rounding: float32's, or a
    bf16 batch's outputs (and the dot route's weights) rounded to bf16."""
    batch = make_batch(
        PREFILL_SHAPES, block_size=16, num_kv_heads=2, group=3, head_dim=64, dtype=dtype, seed=31 + position
    )
    batch = with_keys_scaled(batch, lambda t, n: float("nan") if t == position else 1.0)
    out = prefill(route, batch).double()
    ref = rounded_query_reference(batch) if route == "dot" else batch.expected(torch.float64)
    assert ref.isnan().any() and not ref.isnan().all(), "the batch must hold rows on both sides"
    assert torch.equal(out.isnan(), ref.isnan())
    fine = ~ref.isnan()
    vmax = max(v.abs().max().item() for v in batch.values)
    bound = 1e-4 if dtype == torch.float32 else 2.0**-8 * vmax + 1e-5  # bf16 outputs, and dot's bf16 weights
    assert (out[fine] - ref[fine]).abs().max().item() <= bound


@pytest.mark.skipif(not native_kernel.dot_native(), reason="needs AVX512-BF16")
def test_prefill_vdpbf16ps_agrees_with_its_emulation():
    batch = prefill_batch(64, 3, seed=12)
    native, emulated = prefill("dot", batch, dot_native=True), prefill("dot", batch, dot_native=False)
    vmax = max(v.abs().max().item() for v in batch.values)
    assert (native.double() - emulated.double()).abs().max().item() <= 2.0**-7 * vmax
