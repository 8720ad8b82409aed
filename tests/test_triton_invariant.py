"""The batch-invariant Triton kernels of --deterministic on CUDA
(executor_svc/triton_invariant/): each against a float64 reference, and a
row's result bit-identical whether it is computed alone or at any position
in batches of other rows.

Without a GPU the kernels run in Triton's interpreter on CPU tensors, with
small tiles so that several tiles, K steps and lane blocks take part
(TRITON_INTERPRET=1, set by tests/conftest.py before triton is first imported). The interpreter is not a GPU: it multiplies bfloat16
tiles widened to float32 (matmul.py) and rounds float32 to bfloat16 toward
zero, so these tests check the kernels' design (which sums, in which
order), not a GPU's bits; bench/gpu_check.py checks those where one is lent.
"""

from __future__ import annotations

import dataclasses

import torch

ON_GPU = torch.cuda.is_available()

import pytest  # noqa: E402

pytest.importorskip("triton")

from executor_svc.sampler import RowOps, Sampler, build_sampling_metadata  # noqa: E402
from executor_svc.triton_invariant import matmul, rms_norm, rows  # noqa: E402
from shared.sampling_params import SamplingParams  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
# Interpreter: tiles of 16 (the least tl.dot takes on a GPU) so 64 rows span 4 row tiles,
# 80 columns of K five steps; on a GPU the real configs.
TILES = None if ON_GPU else matmul.TileConfig(16, 16, 16)
BLOCK_D = None if ON_GPU else 32
ROW_BLOCK = rows.BLOCK if ON_GPU else 256
# Batch sizes, and where in each batch the row under test sits: last, in a later tile.
POSITIONS = {1: 0, 3: 2, 17: 11, 64: 35}
BATCH_SIZES = tuple(POSITIONS)
# One ulp of the output dtype and a little, relative (bfloat16: the interpreter truncates).
RTOL = {torch.float32: 2e-6, torch.bfloat16: 2 * 2**-8}


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype=dtype).to(DEVICE)


def in_batches(fn, x: torch.Tensor, row: int = 0):
    """fn over batches of 1, 3, 17 and 64 rows holding x[row] at varied positions
    (the rest other rows of x); returns x[row]'s result from each."""
    results = []
    for m in BATCH_SIZES:
        pos = POSITIONS[m]
        others = [r for r in range(x.shape[0]) if r != row][: m - 1]
        order = others[:pos] + [row] + others[pos:]
        results.append(fn(x[order])[pos])
    return results


def assert_close_to(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(out.double().cpu(), ref.cpu(), rtol=RTOL[dtype], atol=RTOL[dtype] * ref.abs().max())


@DTYPES
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("layout", ["column-major", "row-major"])
def test_linear_matches_float64(dtype, bias, layout):
    # N = 48 and K = 80: neither a multiple of the 32 tile, so edges are masked.
    weight = randn(80, 48, dtype=dtype, seed=1).t() if layout == "column-major" else randn(48, 80, dtype=dtype, seed=1)
    b = randn(48, dtype=dtype, seed=2) if bias else None
    x = randn(37, 80, dtype=dtype, seed=3)
    ref = x.double() @ weight.double().t() + (0 if b is None else b.double())
    out = matmul.linear(x, weight, b, config=TILES)
    assert out.dtype == dtype and out.shape == (37, 48)
    assert_close_to(out, ref, dtype)


@DTYPES
def test_linear_row_is_bit_identical_alone_and_anywhere_in_any_batch(dtype):
    weight = randn(80, 48, dtype=dtype, seed=4).t()
    b = randn(48, dtype=dtype, seed=5)
    x = randn(64, 80, dtype=dtype, seed=6, scale=3.0)
    for row in (0, 21):
        alone = matmul.linear(x[row : row + 1], weight, b, config=TILES)[0]
        for m, got in zip(BATCH_SIZES, in_batches(lambda t: matmul.linear(t, weight, b, config=TILES), x, row)):
            assert torch.equal(got, alone), (row, m)


def test_linear_bits_do_depend_on_the_k_order():
    """What the invariance tests guard: a split-K order (two halves of K summed
    apart, then added, as cuBLAS may do for few rows) gives other bits, so
    equal bits are not a given."""
    weight = randn(48, 400, seed=7)
    x = randn(16, 400, seed=8, scale=3.0)
    whole = matmul.linear(x, weight, config=TILES)
    split = matmul.linear(x[:, :192], weight[:, :192], config=TILES) + matmul.linear(
        x[:, 192:], weight[:, 192:], config=TILES
    )
    # Both orders stay within float32's summation bound (K products, each
    # rounding by at most 2**-24 of the running |sum|), yet differ in bits.
    bound = 2 * 400 * 2**-24 * (x.abs() @ weight.abs().T)
    assert ((split - whole).abs() <= bound).all()
    assert not torch.equal(split, whole)


@DTYPES
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add+norm"])
def test_rms_norm_matches_float64_and_updates_the_residual(dtype, residual):
    h = randn(9, 96, dtype=dtype, seed=9, scale=2.0)
    delta = randn(9, 96, dtype=dtype, seed=10) if residual else None
    weight = randn(96, dtype=dtype, seed=11)
    summed = h.double() + (delta.double() if residual else 0)
    h_before = h.clone()
    out = rms_norm.add_rms_norm(h, delta, weight, 1e-6, block_d=BLOCK_D)
    if residual:
        assert_close_to(h, summed, dtype)  # the residual stream, updated in place
    else:
        assert torch.equal(h, h_before)
    ref = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    assert_close_to(out, ref, dtype)


@DTYPES
def test_rms_norm_row_is_bit_identical_alone_and_anywhere_in_any_batch(dtype):
    h = randn(64, 96, dtype=dtype, seed=12, scale=2.0)
    delta = randn(64, 96, dtype=dtype, seed=13)
    weight = randn(96, dtype=dtype, seed=14)

    def norm(idx):
        hh = h[idx].clone()
        out = rms_norm.add_rms_norm(hh, delta[idx], weight, 1e-5, block_d=BLOCK_D)
        return torch.cat([hh, out], dim=1)  # the updated residual and the output, both per row

    alone = norm([5])[0]
    index = torch.arange(64)
    for m, got in zip(BATCH_SIZES, in_batches(lambda t: norm(t.tolist()), index, row=5)):
        assert torch.equal(got, alone), m


def logits(rows_: int, vocab: int = 1000, seed: int = 15) -> torch.Tensor:
    x = randn(rows_, vocab, seed=seed, scale=4.0)
    x[:, 100:140] = float("-inf")  # masked tokens
    return x


def test_row_reductions_match_float64():
    x = logits(5)
    ref = x.double()
    lse = rows.logsumexp(x, ROW_BLOCK)
    torch.testing.assert_close(lse.double().cpu(), ref.logsumexp(-1, keepdim=True).cpu(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        rows.log_softmax(x, ROW_BLOCK).double().cpu(), ref.log_softmax(-1).cpu(), rtol=1e-6, atol=1e-5
    )
    p = x.softmax(-1)
    torch.testing.assert_close(rows.cumsum(p, ROW_BLOCK).double().cpu(), p.double().cumsum(-1).cpu(), rtol=0, atol=1e-6)
    assert rows.logsumexp(torch.full((1, 300), float("-inf"), device=DEVICE), ROW_BLOCK).item() == float("-inf")


@pytest.mark.parametrize("op", ["logsumexp", "log_softmax", "cumsum"])
def test_row_reduction_is_bit_identical_alone_and_anywhere_in_any_batch(op):
    fn = getattr(rows, op)
    x = logits(64) if op != "cumsum" else logits(64).softmax(-1)
    alone = fn(x[3:4], ROW_BLOCK)[0]
    for m, got in zip(BATCH_SIZES, in_batches(lambda t: fn(t, ROW_BLOCK), x, row=3)):
        assert torch.equal(got, alone), m


def test_sampler_with_triton_row_ops_is_batch_invariant_and_agrees_with_torch():
    """Seeded top-k/top-p/min-p and greedy rows with logprobs, tied logits at the
    thresholds and among the top logprobs: each row alone equals the same row
    in a batch; and the tokens are the torch sampler's (its sums differ only in
    the last bits)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 3000, generator=gen) * 4
    x[:, :50] = x[:, 50:100]  # ties
    x = x.to(DEVICE)
    seeded = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, seed=1234, logprobs=3)
    params = [seeded, SamplingParams(temperature=0.0, logprobs=2), dataclasses.replace(seeded, top_k=0, seed=9)] * 2
    sampler = Sampler(RowOps.triton())

    def sample(rows_, s=sampler):
        md = build_sampling_metadata(
            [params[r] for r in rows_], [[1]] * len(rows_), [[2] * r for r in rows_], 3000, DEVICE
        )
        out = s(x[rows_], md)
        return [(t, lp.logprob, lp.top) for t, lp in zip(out.sampled_token_ids.tolist(), out.logprobs)]

    batch = sample(list(range(5)))
    for r in range(5):
        assert sample([r]) == [batch[r]], r
    assert sample([4, 0, 2]) == [batch[4], batch[0], batch[2]]
    assert [t for t, _, _ in sample(list(range(5)), Sampler())] == [t for t, _, _ in batch]
    # Ties among the top logprobs come out in token-id order.
    tops = [top for _, _, top in batch]
    for top in tops:
        for (id_a, lp_a), (id_b, lp_b) in zip(top, top[1:]):
            assert lp_a > lp_b or (lp_a == lp_b and id_a < id_b)
