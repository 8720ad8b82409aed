"""A batch-invariant linear layer as one Triton kernel: x [M, K] @ weight.T (+ bias).

cuBLAS picks its algorithm, tile shape and split-K by M (and by the GPU), so
a row's output changes with the number of rows beside it. This kernel fixes
everything that orders a row's sums before it sees M:

- one program per [BLOCK_M, BLOCK_N] output tile, tile sizes constant per
  dtype (`CONFIGS`), never chosen from M;
- that program alone reduces the whole K, in BLOCK_K steps from k = 0 up,
  into one float32 accumulator (`tl.dot(a, b, acc)`): no split-K, no atomics,
  no reduction across programs;
- the bias is added to the finished sum, then the result is rounded once to
  the output dtype.

So output element (i, j) is the same chain of tile products whatever M is,
whichever tile row i falls in and whatever the other rows of its tile hold
(a tensor-core MMA computes each output element from its own row and column
only; rows past M are loaded as zeros and never stored). The `M` argument is
excluded from Triton's specialisation (`do_not_specialize`), which would
otherwise compile other code for M == 1 or M % 16 == 0.

The price, as in Thinking Machines' batch_invariant_ops and vLLM's and
SGLang's batch-invariant modes: no split-K for small M, so a decode step
with few rows and a large K runs on fewer programs than cuBLAS would use.
This design is plain tiling, not their persistent kernel (a persistent
loop over tiles changes the schedule, not the sums).

With TRITON_INTERPRET=1 set before triton is first imported, the kernel runs
on CPU tensors in Triton's interpreter (how the tests run it). The
interpreter keeps bfloat16 as raw 16-bit integers, which its tl.dot would
multiply as integers, so there (`WIDEN`) bfloat16 tiles are widened to
float32 first: exact (a product of two bfloat16 fits in a float32), and the
same sums in the same order, but the interpreter's float32 arithmetic, not
a GPU's bf16 MMA; on a GPU the bfloat16 tiles go to tl.dot as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from executor_svc.triton_invariant.launch import check_tensors, interpreted


@dataclass(frozen=True)
class TileConfig:
    """One dtype's tiling; on a GPU every block side must be >= 16 (tl.dot)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


# Per input dtype, never per M. A config may depend on N and K (weight
# shapes, the same for every batch) without breaking invariance; these do
# not, pending measurements on a GPU (bench/gpu_check.py).
CONFIGS = {
    # bf16 64x128x64 in 3 stages: ~72 KB of shared memory per program (H100/H200 have 228 KB);
    # a GPU with 64 KB would refuse this launch and needs a smaller config of its own.
    torch.bfloat16: TileConfig(64, 128, 64),
    torch.float16: TileConfig(64, 128, 64),
    # float32 in IEEE arithmetic (no TF32, as torch's default for float32
    # matmuls): half the tile, twice the steps per byte.
    torch.float32: TileConfig(64, 64, 32, num_stages=2),
}


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
):
    # Axis 0 walks N so that neighbouring programs share the same rows of x.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    m_valid = rm < M
    n_valid = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_valid = kk < K
        a = tl.load(
            x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
            mask=m_valid[:, None] & k_valid[None, :],
            other=0.0,
        )
        # b[k, n] = weight[n, k]: the weight's transpose, read through its strides.
        b = tl.load(
            w_ptr + kk[:, None] * stride_wk + rn[None, :] * stride_wn,
            mask=k_valid[:, None] & n_valid[None, :],
            other=0.0,
        )
        if WIDEN:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on,
        acc.to(out_ptr.dtype.element_ty),
        mask=m_valid[:, None] & n_valid[None, :],
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: None = None,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias) -> [M, N] in x's dtype, batch-invariant.

    The signature is packed_linear.linear's (the model calls either); there
    are no packed copies on CUDA, so `packed` must be None. `config`
    overrides CONFIGS[x.dtype] (tests use small tiles in the interpreter).
    """
    assert packed is None, "the Triton linear takes the weight as it is: no packed copy"
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear: x {tuple(x.shape)} does not multiply weight {tuple(weight.shape)}")
    if weight.dtype != x.dtype or (bias is not None and (bias.dtype != x.dtype or bias.shape != weight.shape[:1])):
        raise ValueError(
            f"linear: x {x.dtype}, weight {weight.dtype}, bias {None if bias is None else (bias.dtype, bias.shape)}"
        )
    if x.dtype not in CONFIGS:
        raise ValueError(f"linear: no tile config for {x.dtype}")
    check_tensors(x, weight)
    cfg = config or CONFIGS[x.dtype]
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))
    _linear_kernel[grid](
        x,
        weight,
        out if bias is None else bias,  # a placeholder pointer, never read without HAS_BIAS
        out,
        m,
        n,
        k,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        out.stride(1),
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        DOT_PRECISION="ieee",
        WIDEN=x.dtype == torch.bfloat16 and interpreted(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
