"""The Triton backend against the dense float64 reference (tests/attention_utils.py):
compiled on a GPU, in Triton's interpreter on CPU (kept tiny: it is slow).
"""

from __future__ import annotations

import random

import pytest
import torch
from attention_utils import (
    assert_matches_reference,
    check_mixed_batch,
    random_shapes,
    run_step,
    to_device,
    triton_backend,
)

from executor_svc.attention.reference import make_batch

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


@pytest.mark.parametrize("block_size,group", [(16, 3), (8, 1), (32, 8)])
def test_triton_backend_bfloat16_matches_reference(block_size, group):
    """On a GPU the kernels' own bf16 arithmetic; in the interpreter q, k, v widened to float32 (triton_backend.py)."""
    check_mixed_batch(
        triton_backend(),
        block_size,
        num_kv_heads=3,
        group=group,
        head_dim=64,
        dtype=torch.bfloat16,
        seed=block_size + group,
        on_device=True,
    )
