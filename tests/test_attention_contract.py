"""What every attention backend does alike, checked on each: it writes exactly
the mapped KV slots, refuses inconsistent metadata and a forward before
`prepare`, takes strided views of a fused QKV projection, and reads a
bfloat16 KV cache under a float32 model (tests/attention_utils.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from attention_utils import (
    as_fused_qkv_views,
    assert_matches_reference,
    backend_named,
    mixed_shapes,
    run_step,
    to_device,
)

from executor_svc.attention import get_backend
from executor_svc.attention.reference import make_batch


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_backends_accept_strided_views_of_a_fused_qkv(backend_name):
    batch = make_batch(
        [(0, 5), (13, 1), (9, 3)], block_size=8, num_kv_heads=1, group=3, head_dim=64, dtype=torch.float32, seed=21
    )
    strided = as_fused_qkv_views(to_device(batch) if backend_name == "triton" else batch)
    assert_matches_reference(run_step(backend_named(backend_name), strided), batch)


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
