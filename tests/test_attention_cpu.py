"""The CPU backend's native kernels (paged decode and prefill in C) against the
dense float64 reference (tests/attention_utils.py), with the shapes that fall
back to torch.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from attention_utils import (
    as_fused_qkv_views,
    assert_matches_reference,
    check_mixed_batch,
    mixed_shapes,
    random_shapes,
    run_step,
)

from executor_svc.attention import get_backend, native_kernel
from executor_svc.attention.cpu_backend import CpuAttentionBackend
from executor_svc.attention.reference import make_batch
from executor_svc.attention.torch_backend import TorchAttentionBackend


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
    check_mixed_batch(
        cpu_backend(),
        block_size,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        dtype=torch.float32,
        seed=block_size * 1000 + head_dim + group,
    )


@pytest.mark.parametrize(
    "block_size,group,head_dim", [(16, 3, 64), (8, 8, 64), (32, 1, 64), (16, 3, 128), (8, 2, 128), (32, 8, 128)]
)
def test_cpu_backend_bfloat16_matches_reference(block_size, group, head_dim):
    """bfloat16 caches at both head_dims the AVX-512 decode path serves (4 and 8 vectors a row)."""
    check_mixed_batch(
        cpu_backend(),
        block_size,
        num_kv_heads=3,
        group=group,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        seed=17 + block_size + head_dim,
    )


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


@pytest.mark.parametrize("portable", [False, True], ids=["avx512", "portable"])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 8), (32, 2)])
def test_decode_kernel_reads_bfloat16_queries_and_writes_bfloat16_outputs(portable, head_dim, group):
    """A bfloat16 model's queries (here strided views of a fused qkv) and
    outputs go to the decode kernel as they are; its result must be the
    float32 path's (float32 queries and outputs, rounded by torch after), bit
    for bit: the kernel widens queries exactly and rounds to nearest even."""
    batch = make_batch(
        [(37, 1), (15, 1), (100, 1), (0, 1), (64, 1)],
        block_size=16,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        seed=head_dim + group,
    )
    backend = CpuAttentionBackend(native_kernel.load(portable=portable))
    out = run_step(backend, as_fused_qkv_views(batch))
    assert out.dtype == torch.bfloat16
    widened = torch.full(batch.query.shape, float("nan"), dtype=torch.float32)
    meta = dataclasses.replace(batch.meta, extra={})
    backend.prepare(meta)
    backend.forward(batch.query.float(), batch.k_cache, batch.v_cache, meta, batch.scale, out=widened)
    assert torch.equal(out, widened.to(torch.bfloat16))
    assert_matches_reference(out, batch)


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
