"""The native prefill kernel's row groups, on every path, head_dim and GQA ratio it serves.

A work item holds count x G query rows in groups of 16, handled up to three
at a time (Q.K and P.V share each broadcast across them): 3, 3, .. then 2 or
1 for the last. These sweep G = 1..8 (G = 4 is the common ratio, 32 heads
over 8) with items of every size 1..16, so every such pattern runs on the
float32 kernel, over a bf16 cache widened, and with the emulated bf16 dot
product. A second test makes scores peak in the hundreds, where the chunk's
running row maximum matters: a maximum that missed a key would overflow,
one that took a masked (future) key would underflow the real ones.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from attention_utils import TOLERANCE, run_step

from executor_svc.attention import native_kernel
from executor_svc.attention.cpu_backend import CpuAttentionBackend
from executor_svc.attention.reference import make_batch
from executor_svc.attention.torch_backend import TorchAttentionBackend

KERNEL = native_kernel.load_prefill()
pytestmark = pytest.mark.skipif(
    KERNEL is None or native_kernel.load() is None, reason="needs the native (AVX-512) prefill kernel"
)

# Items of 16 tokens and of every count c = 1..16 (so c * G rows: every group count 1..8 for
# G = 8, and 3,1 / 3,2 / 3,3 / 3,3,1 for G = 4..7), starting at varied distances from a chunk
# edge, and a fresh prompt.
SHAPES = [(3 * c + (c % 5), 16 + c) for c in range(1, 17)] + [(0, 40)]
PATHS = ["float32", "bf16-widen", "bf16-dot-emulated"]


def batch_for(path: str, head_dim: int, group: int, query_scale: float, seed: int):
    dtype = torch.float32 if path == "float32" else torch.bfloat16
    batch = make_batch(
        SHAPES,
        block_size=8 if group % 2 else 16,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        seed=seed,
    )
    # float32 queries (a widened bf16 model's, as tests/test_attention_dot.py)
    query = torch.randn(batch.query.shape, generator=torch.Generator().manual_seed(seed + 1)) * query_scale
    return dataclasses.replace(batch, query=query)


def run(path: str, batch) -> torch.Tensor:
    if path == "bf16-dot-emulated" and not KERNEL.dot_built:
        pytest.skip("this build has no bf16 dot items")
    route = "dot" if path == "bf16-dot-emulated" else "native"
    backend = CpuAttentionBackend(
        native_kernel.load(),
        KERNEL,
        decode_route="widen",
        prefill_route=route,
        dot_native=False if route == "dot" else None,
    )
    out = run_step(backend, batch)
    assert TorchAttentionBackend.name not in batch.meta.extra, "prefills fell back to SDPA"
    return out


def check(path: str, batch, out: torch.Tensor, tolerance: dict = TOLERANCE[torch.float32]) -> None:
    assert not out.isnan().any() and not out.isinf().any()
    if path == "bf16-dot-emulated":
        # as test_dot_prefills_are_attention_within_the_probabilities_rounding
        ref = dataclasses.replace(batch, query=batch.query.to(torch.bfloat16).float()).expected(torch.float64)
        vmax = max(v.abs().max().item() for v in batch.values)
        err = (out.double() - ref).abs().max().item()
        assert err <= 2.0**-8 * vmax + 1e-5, f"{err} against a bound of {2.0**-8 * vmax}"
    else:
        expected = batch.expected(torch.float64)
        torch.testing.assert_close(out.double(), expected, **tolerance)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", range(1, 9))
def test_prefill_every_group_count_matches_reference(path, head_dim, group):
    batch = batch_for(path, head_dim, group, query_scale=2.0, seed=100 * group + head_dim)
    check(path, batch, run(path, batch))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("head_dim,group", [(64, 4), (128, 8), (64, 7)])
def test_prefill_peaked_scores_match_reference(path, head_dim, group):
    """Scores in the hundreds: exp(s - m) overflows if m misses a key's score, and the
    valid keys' weights underflow if m takes a masked (future) key's. A score's float32
    rounding (~1e-5 of |s| ~ 100) moves a weight by ~1e-5 relative, hence 1e-3 here; a
    wrong max gives inf/NaN or errors of order |V|."""
    batch = batch_for(path, head_dim, group, query_scale=40.0, seed=7 + head_dim + group)
    check(path, batch, run(path, batch), dict(atol=1e-3, rtol=1e-3))
