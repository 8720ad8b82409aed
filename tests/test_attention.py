"""Paged attention backends against a dense float64 reference.

Every batch comes from `make_batch`: fresh random K/V/queries, shuffled block
tables, and NaN in every cache slot no request owns and in the new tokens'
slots until write_kv fills them, so a stray read or a missing write turns the
output NaN. Outputs are written into NaN-filled buffers, so an output element
a backend forgets to write fails too.

The Triton kernels run compiled on CUDA tensors where a GPU exists, and
otherwise in Triton's interpreter on CPU tensors. The interpreter must be
chosen before triton is first imported (triton decorates its own library
functions at import), so this module sets TRITON_INTERPRET=1 at the top and
leaves it set. The interpreter is slow: its cases are kept tiny.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys

import torch

ON_GPU = torch.cuda.is_available()
_TRITON_IMPORTED_TOO_EARLY = False
if not ON_GPU:
    _TRITON_IMPORTED_TOO_EARLY = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from executor_svc.attention import get_backend  # noqa: E402
from executor_svc.attention.reference import make_batch  # noqa: E402
from executor_svc.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from executor_svc.attention.triton_backend import TritonAttentionBackend  # noqa: E402

needs_triton_runtime = pytest.mark.skipif(
    not ON_GPU and _TRITON_IMPORTED_TOO_EARLY,
    reason="triton was imported before TRITON_INTERPRET=1 could be set; run this file on its own",
)
DEVICE = "cuda" if ON_GPU else "cpu"


def triton_backend(block_q: int = 4, block_n: int = 16) -> TritonAttentionBackend:
    """Tiny tiles in the interpreter; the defaults (tl.dot needs >= 16) on a GPU."""
    return TritonAttentionBackend() if ON_GPU else TritonAttentionBackend(block_q=block_q, block_n=block_n)


def backend_named(name: str):
    return get_backend("torch") if name == "torch" else triton_backend()


def to_device(batch):
    if DEVICE == "cpu":
        return batch
    m = batch.meta
    meta = dataclasses.replace(
        m,
        slot_mapping=m.slot_mapping.to(DEVICE),
        query_start_loc=m.query_start_loc.to(DEVICE),
        seq_lens=m.seq_lens.to(DEVICE),
        block_tables=m.block_tables.to(DEVICE),
        extra={},
    )
    moved = {f: getattr(batch, f).to(DEVICE) for f in ("query", "new_key", "new_value", "k_cache", "v_cache")}
    return dataclasses.replace(batch, meta=meta, **moved)


# (cached, new) per request, decodes and prefills interleaved. With block
# size b the cached lengths cover: empty, < b, == b, multiples and
# non-multiples of b, and chunks that start and end mid-block.
def mixed_shapes(b: int) -> list[tuple[int, int]]:
    return [
        (0, 5),  # fresh prefill inside one block
        (2 * b + 3, 1),  # decode, mid-block
        (b - 1, 1),  # decode filling the first block exactly
        (b + 3, 2 * b),  # chunked prefill starting and ending mid-block
        (0, 1),  # one-token prompt
        (b, 1),  # decode opening a new block
        (2 * b, b + 1),  # chunked prefill starting on a block boundary
        (3 * b - 2, 1),  # decode, near the end of a block
        (0, 2 * b),  # fresh prefill of exactly two blocks
    ]


def run_step(backend, batch):
    """prepare, write_kv, forward into a NaN-filled output, as the model runner would."""
    backend.prepare(batch.meta)
    backend.write_kv(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, batch.meta)
    out = torch.full_like(batch.query, float("nan"))
    result = backend.forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale, out=out)
    assert result is out
    return out


TOLERANCE = {
    torch.float64: dict(atol=1e-10, rtol=1e-10),
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
}


def assert_matches_reference(out, batch):
    expected = batch.expected()
    torch.testing.assert_close(out.cpu().to(torch.float64), expected, **TOLERANCE[batch.query.dtype])


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_torch_backend_float64_mixed_batch_matches_reference(block_size, head_dim, group):
    batch = make_batch(
        mixed_shapes(block_size),
        block_size=block_size,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        dtype=torch.float64,
        seed=block_size * 1000 + head_dim + group,
    )
    assert_matches_reference(run_step(get_backend("torch"), batch), batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,group", [(16, 3), (8, 8), (32, 1)])
def test_torch_backend_low_precision_matches_reference(dtype, block_size, group):
    batch = make_batch(
        mixed_shapes(block_size),
        block_size=block_size,
        num_kv_heads=3,
        group=group,
        head_dim=64,
        dtype=dtype,
        seed=7 + block_size,
    )
    assert_matches_reference(run_step(get_backend("torch"), batch), batch)


@pytest.mark.parametrize(
    "pad_tolerance,max_group_tokens,num_groups",
    [(0.0, 1, range(24, 25)), (1.0, 10**9, range(1, 2)), (0.3, 256, range(3, 24))],
)
def test_torch_backend_decode_grouping_does_not_change_results(pad_tolerance, max_group_tokens, num_groups):
    # Many decodes of scattered lengths: one request per group, one group for
    # all, and groups cut by length and by the token cap must all give the
    # reference output.
    rng = random.Random(5)
    shapes = [(rng.randrange(0, 90), 1) for _ in range(24)] + [(10, 12)]
    batch = make_batch(shapes, block_size=16, num_kv_heads=3, group=3, head_dim=64, dtype=torch.float64, seed=11)
    backend = TorchAttentionBackend(pad_tolerance=pad_tolerance, max_group_tokens=max_group_tokens)
    out = run_step(backend, batch)
    assert len(batch.meta.extra[backend.name].decode_groups) in num_groups
    assert_matches_reference(out, batch)


def random_shapes(rng: random.Random, max_requests: int, max_cached: int, max_new: int):
    shapes = []
    for _ in range(rng.randint(1, max_requests)):
        if rng.random() < 0.6:
            shapes.append((rng.randint(0, max_cached), 1))
        else:
            shapes.append((rng.randint(0, max_cached), rng.randint(2, max_new)))
    return shapes


@pytest.mark.parametrize("seed", range(12))
def test_torch_backend_random_batches_match_reference(seed):
    rng = random.Random(seed)
    batch = make_batch(
        random_shapes(rng, 12, 120, 40),
        block_size=rng.choice([8, 16, 32]),
        num_kv_heads=rng.choice([1, 2, 3]),
        group=rng.choice([1, 3, 8]),
        head_dim=rng.choice([64, 128]),
        dtype=torch.float64,
        seed=seed,
    )
    assert_matches_reference(run_step(get_backend("torch"), batch), batch)


def test_torch_backend_reuses_workspace_across_steps_and_returns_fresh_output():
    backend = get_backend("torch")
    for seed, shapes in enumerate([mixed_shapes(16), [(3, 1), (40, 1)], mixed_shapes(16)[::-1]]):
        batch = make_batch(
            shapes, block_size=16, num_kv_heads=3, group=3, head_dim=64, dtype=torch.float32, seed=100 + seed
        )
        backend.prepare(batch.meta)
        backend.write_kv(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, batch.meta)
        out = backend.forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
        assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
        assert_matches_reference(out, batch)


def as_fused_qkv_views(batch):
    """The model runner slices q, k, v out of one fused projection: strided views, not contiguous tensors."""
    q, k, v = batch.query, batch.new_key, batch.new_value
    fused = torch.cat([q, k, v], dim=1)
    nq, nk = q.shape[1], k.shape[1]
    views = dict(query=fused[:, :nq], new_key=fused[:, nq : nq + nk], new_value=fused[:, nq + nk :])
    assert not views["query"].is_contiguous() and not views["new_key"].is_contiguous()
    return dataclasses.replace(batch, **views)


@needs_triton_runtime
@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_backends_accept_strided_views_of_a_fused_qkv(backend_name):
    batch = make_batch(
        [(0, 5), (13, 1), (9, 3)], block_size=8, num_kv_heads=1, group=3, head_dim=64, dtype=torch.float32, seed=21
    )
    strided = as_fused_qkv_views(to_device(batch) if backend_name == "triton" else batch)
    assert_matches_reference(run_step(backend_named(backend_name), strided), batch)


# Interpreter cases: at most two KV heads, few tokens, tiles much smaller
# than on a GPU. Each line varies block size, head dim, GQA ratio and tiling
# so that key tiles both split blocks and span several of them.
TRITON_CASES = [
    # block_size, head_dim, group, num_kv_heads, block_q, block_n
    (8, 64, 3, 2, 4, 16),
    (16, 128, 1, 1, 4, 8),
    (32, 64, 8, 1, 1, 16),
    (16, 64, 3, 1, 8, 32),
]


@needs_triton_runtime
@pytest.mark.parametrize("block_size,head_dim,group,num_kv_heads,block_q,block_n", TRITON_CASES)
def test_triton_backend_mixed_batch_matches_reference(block_size, head_dim, group, num_kv_heads, block_q, block_n):
    b = block_size
    shapes = [(0, 5), (2 * b + 3, 1), (b - 1, 1), (b + 3, 6), (0, 1), (b, 1), (2 * b, 3)]
    batch = make_batch(
        shapes,
        block_size=b,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        dtype=torch.float32,
        seed=b + head_dim + group,
    )
    assert_matches_reference(run_step(triton_backend(block_q, block_n), to_device(batch)), batch)


@needs_triton_runtime
@pytest.mark.parametrize("seed", range(2))
def test_triton_backend_random_batches_match_reference(seed):
    rng = random.Random(1000 + seed)
    batch = make_batch(
        random_shapes(rng, 5, 40, 9),
        block_size=rng.choice([8, 16]),
        num_kv_heads=1,
        group=rng.choice([1, 3]),
        head_dim=64,
        dtype=torch.float32,
        seed=seed,
    )
    assert_matches_reference(run_step(triton_backend(), to_device(batch)), batch)


@pytest.mark.skipif(not ON_GPU, reason="bfloat16 Triton kernels are checked on a GPU only")
@pytest.mark.parametrize("block_size,group", [(16, 3), (8, 1), (32, 8)])
def test_triton_backend_bfloat16_on_gpu_matches_reference(block_size, group):
    batch = make_batch(
        mixed_shapes(block_size),
        block_size=block_size,
        num_kv_heads=3,
        group=group,
        head_dim=64,
        dtype=torch.bfloat16,
        seed=block_size + group,
    )
    assert_matches_reference(run_step(triton_backend(), to_device(batch)), batch)


@needs_triton_runtime
@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_write_kv_writes_exactly_the_mapped_slots(backend_name):
    num_blocks, block_size, num_kv_heads, head_dim = 6, 8, 2, 64
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    # Scattered, unordered slots across blocks, including a block's first and last slot.
    slots = torch.tensor([17, 8, 47, 3, 31, 40, 15], dtype=torch.int64)
    key = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen)
    value = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen)
    batch = make_batch([(0, len(slots))], block_size=block_size, num_kv_heads=num_kv_heads, group=1, head_dim=head_dim)
    batch = dataclasses.replace(batch, new_key=key, new_value=value, k_cache=k_cache.clone(), v_cache=v_cache.clone())
    batch.meta.slot_mapping = slots
    batch = to_device(batch)

    backend_named(backend_name).write_kv(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, batch.meta)

    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    for cache, before, new in ((batch.k_cache, k_cache, key), (batch.v_cache, v_cache, value)):
        after = cache.cpu().view(-1, num_kv_heads, head_dim)
        assert torch.equal(after[slots], new)
        assert torch.equal(after[untouched], before.view(-1, num_kv_heads, head_dim)[untouched])


@needs_triton_runtime
@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_forward_before_prepare_raises(backend_name):
    batch = to_device(make_batch([(3, 1)], block_size=8, num_kv_heads=1, group=1, head_dim=64))
    with pytest.raises(RuntimeError, match="prepare"):
        backend_named(backend_name).forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_prepare_rejects_inconsistent_metadata(backend_name):
    batch = make_batch([(3, 1), (0, 4)], block_size=8, num_kv_heads=1, group=1, head_dim=64)
    batch.meta.seq_lens_cpu = [4, 3]  # request 1 has 4 query tokens but only 3 in its sequence
    with pytest.raises(ValueError, match="request 1"):
        backend_named(backend_name).prepare(batch.meta)


def test_get_backend_rejects_unknown_name():
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("flash")


# The CPU backend: native decode kernel + torch prefills. It computes in
# float32, so float64 inputs are compared at float32 tolerance.
def cpu_backend():
    backend = get_backend("cpu")
    assert backend.name == "cpu", "the native kernel did not build (is a C compiler installed?)"
    return backend


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_cpu_backend_float32_mixed_batch_matches_reference(block_size, head_dim, group):
    batch = make_batch(
        mixed_shapes(block_size),
        block_size=block_size,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        dtype=torch.float32,
        seed=block_size * 1000 + head_dim + group,
    )
    assert_matches_reference(run_step(cpu_backend(), batch), batch)


@pytest.mark.parametrize("block_size,group", [(16, 3), (8, 8), (32, 1)])
def test_cpu_backend_bfloat16_matches_reference(block_size, group):
    batch = make_batch(
        mixed_shapes(block_size),
        block_size=block_size,
        num_kv_heads=3,
        group=group,
        head_dim=64,
        dtype=torch.bfloat16,
        seed=17 + block_size,
    )
    assert_matches_reference(run_step(cpu_backend(), batch), batch)


@pytest.mark.parametrize("seed", range(8))
def test_cpu_backend_random_batches_match_reference(seed):
    rng = random.Random(1000 + seed)
    batch = make_batch(
        random_shapes(rng, 16, 300, 40),
        block_size=rng.choice([8, 16, 32]),
        num_kv_heads=rng.choice([1, 2, 3]),
        group=rng.choice([1, 3, 8]),
        head_dim=rng.choice([64, 128]),
        dtype=torch.float32,
        seed=seed,
    )
    assert_matches_reference(run_step(cpu_backend(), batch), batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 8), (32, 2)])
def test_portable_native_kernel_matches_reference(dtype, head_dim, group):
    """The plain-C kernel that CPUs without AVX-512 (and other shapes) run."""
    from executor_svc.attention import native_kernel
    from executor_svc.attention.cpu_backend import CpuAttentionBackend

    kernel = native_kernel.load(portable=True)
    assert kernel is not None, "the portable native kernel did not build"
    batch = make_batch(
        mixed_shapes(16) + [(300, 1)],
        block_size=16,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        seed=head_dim + group,
    )
    assert_matches_reference(run_step(CpuAttentionBackend(kernel), batch), batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_long_peaked_decodes_match_reference(dtype):
    """Histories of many 16-token chunks under a sharp softmax: the online
    softmax must rescale its running sums correctly each time the max moves."""
    batch = make_batch(
        [(1000, 1), (517, 1), (33, 1), (15, 1)],
        block_size=16,
        num_kv_heads=3,
        group=3,
        head_dim=64,
        dtype=dtype,
        seed=41,
    )
    batch = dataclasses.replace(batch, query=batch.query * 6)
    assert_matches_reference(run_step(cpu_backend(), batch), batch)


@pytest.mark.parametrize("num_decodes", [1, 2, 9])
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_backend_decode_work_splits_match_reference(num_decodes, threads):
    """The AVX-512 kernel gives each thread whole decodes (all KV heads) when
    there are at least two decodes per thread, else (decode, KV head) items:
    both splits must give the reference answer."""
    shapes = [(37 + 61 * i, 1) for i in range(num_decodes)]
    batch = make_batch(
        shapes,
        block_size=16,
        num_kv_heads=3,
        group=3,
        head_dim=64,
        dtype=torch.float32,
        seed=num_decodes * 10 + threads,
    )
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert_matches_reference(run_step(cpu_backend(), batch), batch)
    finally:
        torch.set_num_threads(before)


def test_cpu_backend_copies_queries_whose_head_dim_is_strided():
    """The kernels read unit-stride head rows; a query with a strided last
    dimension must be made contiguous first, not read as if it were."""
    batch = make_batch(
        mixed_shapes(16), block_size=16, num_kv_heads=3, group=3, head_dim=64, dtype=torch.float32, seed=23
    )
    strided = batch.query.transpose(1, 2).contiguous().transpose(1, 2)  # same values, stride(2) != 1
    assert strided.stride(2) != 1
    assert_matches_reference(run_step(cpu_backend(), dataclasses.replace(batch, query=strided)), batch)


def test_cpu_backend_accepts_strided_views_of_a_fused_qkv():
    batch = make_batch(
        [(0, 5), (13, 1), (9, 3), (40, 1)],
        block_size=8,
        num_kv_heads=1,
        group=3,
        head_dim=64,
        dtype=torch.float32,
        seed=22,
    )
    assert_matches_reference(run_step(cpu_backend(), as_fused_qkv_views(batch)), batch)


def test_cpu_backend_decodes_only_and_prefills_only():
    for shapes in ([(5, 1), (0, 1), (31, 1)], [(0, 7), (12, 4)]):
        batch = make_batch(shapes, block_size=16, num_kv_heads=3, group=3, head_dim=64, dtype=torch.float32, seed=3)
        assert_matches_reference(run_step(cpu_backend(), batch), batch)


def native_prefill_expected() -> bool:
    """Decided by the CPU and the compiler, not by asking the kernel: a kernel
    that wrongly refused every shape must fail the tests below, not skip them."""
    from executor_svc.attention import native_kernel
    from executor_svc.native_build import cpu_flags

    return "avx512f" in cpu_flags() and native_kernel.load_prefill() is not None


needs_native_prefill = pytest.mark.skipif(
    not native_prefill_expected(), reason="the native prefill kernel needs AVX-512 and a C compiler"
)


@needs_native_prefill
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 8), (64, 1)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_cpu_backend_prefills_run_natively_and_match_reference(dtype, head_dim, group, block_size):
    """Long and chunked prefills (query blocks of 16 crossing blocks and the
    causal diagonal at every offset) through paged_prefill.c, not SDPA."""
    shapes = [(0, 300), (37, 45), (250, 17), (0, 2), (128, 16), (5, 1)]
    batch = make_batch(
        shapes,
        block_size=block_size,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        seed=head_dim + group + block_size,
    )
    out = run_step(cpu_backend(), batch)
    assert TorchAttentionBackend.name not in batch.meta.extra, "prefills fell back to SDPA"
    assert_matches_reference(out, batch)


@needs_native_prefill
@pytest.mark.parametrize("head_dim,group", [(32, 2), (64, 9)])
def test_cpu_backend_prefills_of_unsupported_shapes_fall_back_to_sdpa(head_dim, group):
    """head_dim 32, or more than 8 query heads per KV head, have no native
    prefill instance: SDPA serves them, still correct."""
    batch = make_batch(
        mixed_shapes(16), block_size=16, num_kv_heads=2, group=group, head_dim=head_dim, dtype=torch.float32, seed=5
    )
    out = run_step(cpu_backend(), batch)
    assert TorchAttentionBackend.name in batch.meta.extra
    assert_matches_reference(out, batch)


@pytest.mark.parametrize("backend_name", ["cpu", "torch"])
def test_bfloat16_kv_cache_under_a_float32_model_matches_reference_on_rounded_kv(backend_name):
    """--kv-cache-dtype bfloat16: K/V are stored rounded, everything else stays float32."""
    batch = make_batch(
        mixed_shapes(16), block_size=16, num_kv_heads=3, group=3, head_dim=64, dtype=torch.float32, seed=31
    )
    rounded = lambda t: t.to(torch.bfloat16).to(torch.float32)  # noqa: E731
    narrow = dataclasses.replace(
        batch,
        k_cache=batch.k_cache.to(torch.bfloat16),
        v_cache=batch.v_cache.to(torch.bfloat16),
        keys=[rounded(k) for k in batch.keys],
        values=[rounded(v) for v in batch.values],
    )
    out = run_step(get_backend(backend_name), narrow)
    assert out.dtype == torch.float32
    assert_matches_reference(out, narrow)
