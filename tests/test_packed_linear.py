"""The native packed GEMM (executor_svc/packed_linear.py) against a float64 reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executor_svc import packed_linear
from executor_svc.packed_linear import PACKED_MAX_ROWS, PACKED_MIN_ROWS, linear, pack

pytestmark = pytest.mark.skipif(packed_linear.kernel() is None, reason="needs x86 AVX-512 and a C compiler")

# (out, in): a single partial panel, a partial last panel, SmolLM2's qkv, a long odd K.
SHAPES = [(5, 1), (50, 64), (960, 576), (1000, 1537)]


def reference(x, w, bias):
    out = x.double() @ w.double().t()
    return out if bias is None else out + bias.double()


def assert_close(got: torch.Tensor, want: torch.Tensor, k: int) -> None:
    # float32 sums of k products of N(0,1) values: errors grow like sqrt(k).
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5 * k**0.5 * 4)


@pytest.mark.parametrize("rows", [2, 7, 8, 9, 64, 100, PACKED_MAX_ROWS - 1, PACKED_MAX_ROWS])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_reference(rows, shape, with_bias):
    gen = torch.Generator().manual_seed(rows * 7 + shape[0])
    n, k = shape
    w, x = torch.randn(n, k, generator=gen), torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    assert_close(linear(x, w, bias, pack(w)), reference(x, w, bias), k)


def test_kernel_writes_exactly_its_outputs():
    """Into a poisoned output with a wider row stride: every [M, N] element is
    written, nothing past N is (the last panel's masked stores)."""
    n, k, m, ldc = 50, 64, 11, 53
    gen = torch.Generator().manual_seed(0)
    w, x, bias = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    out = torch.full((m, ldc), float("nan"))
    kern = packed_linear.kernel()
    assert kern.gemm(out.data_ptr(), ldc, x.data_ptr(), k, pack(w).data_ptr(), bias.data_ptr(), m, n, k, 2) == 0
    assert_close(out[:, :n], reference(x, w, bias), k)
    assert out[:, n:].isnan().all()


def test_kernel_over_several_row_chunks():
    """Called directly past linear()'s range: 600 rows are three 256-row chunks
    (the last partial), shared out between the threads with the panels."""
    n, k, m = 200, 96, 600
    gen = torch.Generator().manual_seed(2)
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    out = torch.full((m, n), float("nan"))
    assert packed_linear.kernel().gemm(out.data_ptr(), n, x.data_ptr(), k, pack(w).data_ptr(), None, m, n, k, 2) == 0
    assert_close(out, reference(x, w, None), k)


def test_strided_inputs():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(96, 40, generator=gen)
    wide = torch.randn(16, 47, generator=gen)
    rows_strided = wide[:, :40]  # row stride 47: passed to the kernel as its lda
    cols_strided = torch.randn(16, 80, generator=gen)[:, ::2]  # copied first
    for x in (rows_strided, cols_strided):
        assert_close(linear(x, w, None, pack(w)), reference(x, w, None), 40)


def test_packed_layout():
    w = torch.arange(50 * 3, dtype=torch.float32).view(50, 3)
    panels = pack(w)
    width = packed_linear.kernel().panel_width
    assert panels.shape == (-(-50 // width), 3, width) and panels.is_contiguous()
    assert panels[0, 2, 5] == w[5, 2] and panels[1, 1, 50 - width - 1] == w[49, 1]
    assert (panels[1, :, 50 - width:] == 0).all()


@pytest.mark.parametrize("rows", [0, 1, PACKED_MAX_ROWS + 1, 300])
def test_rows_outside_the_packed_range_go_to_torch(rows):
    """One row and large batches are as fast or faster through MKL: same result as F.linear, bit for bit."""
    w, x = torch.randn(60, 32), torch.randn(rows, 32)
    assert PACKED_MIN_ROWS == 2
    assert torch.equal(linear(x, w, None, pack(w)), F.linear(x, w))


def test_empty_panels_mean_plain_linear():
    w, x, b = torch.randn(8, 4), torch.randn(5, 4), torch.randn(8)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))


def test_cpu_gemm_setting_resolves():
    from executor_svc.config import parse_config
    from executor_svc.worker import use_packed_gemm

    cpu = torch.device("cpu")
    assert use_packed_gemm("auto", cpu, torch.float32) and use_packed_gemm("native", cpu, torch.float32)
    assert not use_packed_gemm("torch", cpu, torch.float32)
    assert not use_packed_gemm("auto", cpu, torch.bfloat16)  # float32 only: auto falls back
    with pytest.raises(ValueError, match="--cpu-gemm native needs float32"):
        use_packed_gemm("native", cpu, torch.bfloat16)
    assert parse_config(["--cpu-gemm", "torch"], environ={}).cpu_gemm == "torch"
    with pytest.raises(SystemExit):
        parse_config(["--cpu-gemm", "blas"], environ={})
