"""The CUDA --deterministic kernels on a real GPU: correct, batch-invariant, and at what cost.

    python -m bench.gpu_check [--quick] [--rounds 20]
    python -m bench.gpu_check --interpreter     # tiny shapes on CPU: does the script run?

Needs a CUDA device (exits 2 without one), except with --interpreter, which
runs tiny shapes through Triton's interpreter on CPU to check the script
itself (its timings mean nothing there). The tests run these kernels in
Triton's interpreter only, which neither multiplies bfloat16 on tensor cores
nor rounds as a GPU does (tests/test_triton_invariant.py); this script is
the check on hardware, in float32 and bfloat16:

1. Reference: each kernel (triton_invariant/: linear, RMSNorm + residual,
   log_softmax/logsumexp/cumsum) against float64 within a dtype tolerance.
2. Invariance, bit for bit: a row computed alone equals the same row at a
   varied position inside batches of 3 .. 4,096 rows (linear, norm), 1 .. 64
   rows (row reductions); the Triton attention of a request's tokens decoded
   one by one equals the same tokens prefilled in one chunk and in chunks
   beside other decodes. The same check of cuBLAS / torch is printed beside
   it for contrast (expected to differ somewhere; not a failure).
3. Cost: median time of the invariant kernel vs cuBLAS (F.linear) and torch's
   RMSNorm, per shape and row count.

Prints one line per check and "ALL OK" (exit 0) or the failures (exit 1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

DTYPES = (torch.float32, torch.bfloat16)
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7}
# (name, N, K): SmolLM2-135M's qkv and gate_up, a 7B's qkv and down, a 150k vocabulary head.
LINEAR_SHAPES = [("smollm qkv", 960, 576), ("smollm gate_up", 3072, 576), ("7b qkv", 12288, 4096)]
LINEAR_SHAPES_FULL = LINEAR_SHAPES + [("7b down", 4096, 11008), ("head 152k", 152064, 3584)]
ROWS = (1, 3, 17, 64, 128, 257, 1024, 4096)
NORM_DIMS = (576, 4096, 8192)
VOCAB = 152064
SEQ_LEN = 300
DEVICE = "cuda"


def _interpreter_sizes() -> None:
    """--interpreter: CPU tensors, tiny shapes."""
    global LINEAR_SHAPES, LINEAR_SHAPES_FULL, ROWS, NORM_DIMS, VOCAB, SEQ_LEN, DEVICE
    LINEAR_SHAPES = LINEAR_SHAPES_FULL = [("tiny", 144, 80)]
    ROWS, NORM_DIMS, VOCAB, SEQ_LEN, DEVICE = (1, 3, 17, 70), (96,), 3000, 40, "cpu"


def positions(m: int) -> int:
    return 0 if m == 1 else (m * 5) // 7  # inside a later tile for most m


def row_in_batches(fn, x: torch.Tensor, counts) -> list[tuple[int, bool, float]]:
    """(rows, equal, max|d|) of x[0]'s result alone vs at positions(m) among m rows."""
    alone = fn(x[:1])[0]
    out = []
    for m in counts:
        pos = positions(m)
        idx = list(range(1, m))
        idx.insert(pos, 0)
        got = fn(x[idx])[pos]
        out.append((m, torch.equal(got, alone), (got.double() - alone.double()).abs().max().item()))
    return out


def timed(fn, rounds: int) -> float:
    """Median microseconds of fn() over `rounds` runs after two warm-ups."""
    for _ in range(2):
        fn()
    if DEVICE == "cpu":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


class Report:
    def __init__(self):
        self.failures: list[str] = []

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
        if not ok:
            self.failures.append(name)

    @staticmethod
    def info(name: str, detail: str) -> None:
        print(f"     {name} {detail}", flush=True)


def check_linear(rep: Report, dtype, shapes, rounds: int) -> None:
    from executor_svc.triton_invariant import matmul

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for name, n, k in shapes:
        weight = torch.randn(k, n, device=DEVICE, generator=gen).to(dtype).t()  # column-major, as model.py
        bias = torch.randn(n, device=DEVICE, generator=gen).to(dtype)
        x = torch.randn(max(ROWS), k, device=DEVICE, generator=gen).to(dtype)
        ref = x[:64].double() @ weight.double().t() + bias.double()
        err = (matmul.linear(x[:64], weight, bias).double() - ref).abs().max().item()
        tol = RTOL[dtype] * ref.abs().max().item() * 4
        rep.check(f"linear {name} {dtype} vs float64", err <= tol, f"max|d| {err:.3g} (tol {tol:.3g})")
        res = row_in_batches(lambda t, w=weight, b=bias: matmul.linear(t, w, b), x, ROWS)
        rep.check(f"linear {name} {dtype} invariant", all(eq for _, eq, _ in res), str([(m, eq) for m, eq, _ in res]))
        cublas = row_in_batches(lambda t, w=weight, b=bias: F.linear(t, w, b), x, ROWS)
        rep.info(f"cuBLAS {name} {dtype} row equal alone?", str([(m, eq) for m, eq, _ in cublas]))
        for m in sorted({min(m, max(ROWS)) for m in (1, 64, 1024, 4096)}):
            ours = timed(lambda xm=x[:m], w=weight, b=bias: matmul.linear(xm, w, b), rounds)
            theirs = timed(lambda xm=x[:m], w=weight, b=bias: F.linear(xm, w, b), rounds)
            rep.info(
                f"time linear {name} {dtype} M={m}", f"{ours:.1f} us vs cuBLAS {theirs:.1f} us: {ours / theirs:.2f}x"
            )


def check_rms_norm(rep: Report, dtype, rounds: int) -> None:
    from executor_svc.layer_ops import add_rms_norm as torch_add_rms_norm
    from executor_svc.triton_invariant import rms_norm

    gen = torch.Generator(device=DEVICE).manual_seed(1)
    for dim in NORM_DIMS:
        h = torch.randn(max(ROWS), dim, device=DEVICE, generator=gen).to(dtype)
        delta = torch.randn(max(ROWS), dim, device=DEVICE, generator=gen).to(dtype)
        w = torch.randn(dim, device=DEVICE, generator=gen).to(dtype)
        hh = h[:64].clone()
        out = rms_norm.add_rms_norm(hh, delta[:64], w, 1e-6)
        s = (h[:64].float() + delta[:64].float()).to(dtype).double()
        ref = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
        err = (out.double() - ref).abs().max().item()
        tol = RTOL[dtype] * ref.abs().max().item() * 4
        # The residual h + delta rounds as torch's add does: exactly on a GPU; the
        # interpreter rounds toward zero, within one ulp.
        residual_ok = (
            torch.equal(hh, s.to(dtype)) if DEVICE == "cuda" else torch.allclose(hh.double(), s, rtol=2**-7, atol=0)
        )
        rep.check(f"rms_norm {dim} {dtype} vs float64", err <= tol and residual_ok, f"max|d| {err:.3g}")

        def ours(t, fn=rms_norm.add_rms_norm, h=h, delta=delta, w=w):
            rows = t[:, 0].long()
            hh = h[rows].clone()
            return torch.cat([hh, fn(hh, delta[rows], w, 1e-6)], dim=1)

        idx = torch.arange(max(ROWS), device=DEVICE, dtype=torch.float32)[:, None]  # row numbers, exact
        res = row_in_batches(ours, idx, ROWS)
        rep.check(f"rms_norm {dim} {dtype} invariant", all(eq for _, eq, _ in res), str([(m, eq) for m, eq, _ in res]))
        base = row_in_batches(lambda t: ours(t, torch_add_rms_norm), idx, ROWS)
        rep.info(f"torch rms_norm {dim} {dtype} row equal alone?", str([(m, eq) for m, eq, _ in base]))
        for m in sorted({min(m, max(ROWS)) for m in (1, 64, 4096)}):
            a = timed(lambda hm=h[:m], dm=delta[:m], w=w: rms_norm.add_rms_norm(hm, dm, w, 1e-6), rounds)
            b = timed(lambda hm=h[:m], dm=delta[:m], w=w: torch_add_rms_norm(hm, dm, w, 1e-6), rounds)
            rep.info(f"time rms_norm {dim} {dtype} M={m}", f"{a:.1f} us vs torch {b:.1f} us: {a / b:.2f}x")


def check_rows(rep: Report) -> None:
    from executor_svc.triton_invariant import rows

    gen = torch.Generator(device=DEVICE).manual_seed(2)
    x = torch.randn(64, VOCAB, device=DEVICE, generator=gen) * 4
    x[:, 1000:1100] = float("-inf")
    p = x.softmax(-1)
    cases = {
        "logsumexp": (rows.logsumexp, x, lambda t: t.double().logsumexp(-1, keepdim=True), 1e-5),
        "log_softmax": (rows.log_softmax, x, lambda t: t.double().log_softmax(-1), 1e-4),
        "cumsum": (rows.cumsum, p, lambda t: t.double().cumsum(-1), 1e-5),
    }
    torch_ops = {
        "logsumexp": lambda t: t.logsumexp(-1, keepdim=True),
        "log_softmax": lambda t: t.log_softmax(-1),
        "cumsum": lambda t: t.cumsum(-1),
    }
    for name, (fn, inp, ref_fn, tol) in cases.items():
        err = (fn(inp[:8]).double() - ref_fn(inp[:8])).abs().nan_to_num(0.0).max().item()
        rep.check(f"{name} vs float64", err <= tol, f"max|d| {err:.3g}")
        res = row_in_batches(fn, inp, (1, 3, 17, 64))
        rep.check(f"{name} invariant", all(eq for _, eq, _ in res), str([(m, eq) for m, eq, _ in res]))
        base = row_in_batches(torch_ops[name], inp, (1, 3, 17, 64))
        rep.info(f"torch {name} row equal alone?", str([(m, eq) for m, eq, _ in base]))


def check_attention(rep: Report, dtype) -> None:
    from executor_svc.attention.reference import attend_in_steps
    from executor_svc.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend()
    seq_len = SEQ_LEN
    decoded = attend_in_steps(backend, [1] * seq_len, dtype, seq_len, device=DEVICE)
    for chunks, others in (([seq_len], 0), ([7] * 43, 0), ([64] * 5, 3), ([1, seq_len // 2, seq_len], 2)):
        got = attend_in_steps(backend, chunks, dtype, seq_len, others=others, device=DEVICE)
        d = (got.double() - decoded.double()).abs().max().item()
        rep.check(
            f"attention {dtype} decoded == chunks {chunks[:3]} beside {others}",
            torch.equal(got, decoded),
            f"max|d| {d:.3g}",
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the smaller linear shapes only")
    p.add_argument("--rounds", type=int, default=20, help="timed runs per case (medians)")
    p.add_argument("--interpreter", action="store_true", help="tiny shapes on CPU in Triton's interpreter")
    a = p.parse_args(argv)
    if a.interpreter:
        if "triton" in sys.modules:
            print("--interpreter: triton was imported before TRITON_INTERPRET=1 could be set", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"
        _interpreter_sizes()
    elif not torch.cuda.is_available():
        print("bench.gpu_check needs a CUDA device; none here", file=sys.stderr)
        return 2
    name = "Triton interpreter on CPU" if a.interpreter else torch.cuda.get_device_name()
    print(f"device: {name}, torch {torch.__version__}", flush=True)
    rep = Report()
    for dtype in DTYPES:
        check_linear(rep, dtype, LINEAR_SHAPES if a.quick else LINEAR_SHAPES_FULL, a.rounds)
        check_rms_norm(rep, dtype, a.rounds)
        check_attention(rep, dtype)
    check_rows(rep)
    if rep.failures:
        print(f"{len(rep.failures)} FAILED: {rep.failures}")
        return 1
    print("ALL OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
