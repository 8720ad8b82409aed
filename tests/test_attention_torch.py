"""The torch backend (pure PyTorch paged attention, the reference backend on
every device) against the dense float64 reference (tests/attention_utils.py).
"""

from __future__ import annotations

import random

import pytest
import torch
from attention_utils import assert_matches_reference, check_mixed_batch, mixed_shapes, random_shapes, run_step

from executor_svc.attention import get_backend
from executor_svc.attention.reference import make_batch
from executor_svc.attention.torch_backend import TorchAttentionBackend


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_torch_backend_float64_mixed_batch_matches_reference(block_size, head_dim, group):
    check_mixed_batch(
        get_backend("torch"),
        block_size,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        dtype=torch.float64,
        seed=block_size * 1000 + head_dim + group,
    )


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
