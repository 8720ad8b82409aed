"""A greedy step's tokens straight from the LM head's tiles (gemm_epilogues.argmax_dot,
native/bf16_dot_gemm.h: argmax): each row's argmax of the dot route's logits, which
are never written, must be what the sampler's argmax says over those logits: the
first index of the largest value, or of the first NaN, 0 for a row of only -inf;
and the runner must take it only where the sampler would do nothing but argmax."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import replace

import pytest
import torch

from executor_svc import fused_ops, gemm_epilogues, packed_linear
from executor_svc.gemm_epilogues import argmax_dot
from executor_svc.packed_linear import PackedWeight, linear, pack_bf16
from executor_svc.sampler import argmax
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(packed_linear.kernel() is None, reason="needs x86 AVX-512 and a C compiler")

DOT = ((1, "dot"),)
VOCAB, HIDDEN = 1000, 64  # 1,000 = 20 panels of 48 and one of 40 columns
TIED = (20, 33, 51, 500, 999)  # equal logits: a lane's, a panel's and the other thread's columns


def head(seed: int) -> tuple[torch.Tensor, PackedWeight]:
    """A bf16 head whose TIED rows are one and the same row, `w[TIED[0]]`: an
    activation row along it makes their logits equal and far the largest."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN**0.5
    w[list(TIED)] = torch.randn(HIDDEN, generator=gen)
    w = w.to(torch.bfloat16)
    return w, PackedWeight(None, pack_bf16(w), bf16_routes=DOT)


def logits_argmax(x, w, packed, bias=None) -> torch.Tensor:
    """What the sampler answers: the dot route's float32 logits, then argmax."""
    logits = linear(x, w, bias, packed)
    want = logits.argmax(dim=-1)
    assert torch.equal(fused_ops.argmax_rows(logits), want)  # the sampler's native argmax is torch's
    return want


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 64, 257, 600])
@pytest.mark.parametrize("native", [False, True], ids=["emulated", "vdpbf16ps"])
def test_argmax_on_the_head_tiles_is_the_argmax_of_its_logits(rows, native, monkeypatch):
    """Random rows, rows whose largest logit is tied across lanes, panels and
    threads (the first must win), and a NaN row (its first column, 0), within
    one tile, across tiles and across 256-row chunks."""
    if native and not packed_linear.kernel().bf16_dot_native:
        pytest.skip("needs AVX512-BF16")
    k = dataclasses.replace(packed_linear.kernel(), bf16_dot_native=native)
    monkeypatch.setattr(packed_linear, "kernel", lambda: k)
    w, packed = head(rows)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows + 1))
    tied_rows = list(range(0, rows, 3))
    x[tied_rows] = w[TIED[0]].float()
    if rows > 2:
        x[2, 5] = float("nan")
    want = logits_argmax(x, w, packed)
    assert (want[tied_rows] == TIED[0]).all() and (rows <= 2 or want[2] == 0)
    assert torch.equal(argmax_dot(x, None, packed), want)


@pytest.mark.parametrize(
    "edit,answer",
    [
        ({}, None),
        ({"all": float("-inf")}, 0),  # nothing beats -inf: index 0, as torch.argmax
        ({"all": float("-inf"), 777: 0.0}, 777),
        ({300: float("inf"), 700: float("nan"), 900: float("nan")}, 700),  # the first NaN beats +inf
        ({300: float("inf"), 960: float("inf")}, 300),
    ],
    ids=["finite", "all-minus-inf", "one-finite", "first-nan", "tied-inf"],
)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_bias_of_infinities_and_nans_answers_as_torch_argmax(edit, answer, threads):
    """On 2 and 3 threads the NaN at 700 and the +inf at 300 fall to
    different threads, as do the two +infs."""
    w, packed = head(3)
    bias = torch.randn(VOCAB)
    if "all" in edit:
        bias.fill_(edit["all"])
    for column, value in edit.items():
        if column != "all":
            bias[column] = value
    x = torch.randn(70, HIDDEN)
    want = logits_argmax(x, w, packed, bias)
    if answer is not None:
        assert (want == answer).all()
    with torch_threads(threads):
        assert torch.equal(argmax_dot(x, bias, packed), want)


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [9, 64, 300])
def test_any_thread_count_gives_the_same_tokens(rows):
    """Threads take runs of columns and the runs are reduced in column order:
    1, 3 and 8 threads (one with nothing of some rows) answer alike."""
    w, packed = head(rows)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(5))
    x[::4] = w[TIED[0]].float()
    want = logits_argmax(x, w, packed)
    for threads in (1, 3, 8):
        with torch_threads(threads):
            assert torch.equal(argmax_dot(x, None, packed), want), f"{threads} threads"


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_a_nan_mid_row_and_signed_zeros(threads):
    """A NaN weight in head row 613 makes column 613 NaN in every row: each
    row's answer, whichever thread holds it. Columns 100 and 900 at -0.0 and
    +0.0, every other -inf: the two zeros tie, and the first wins, as in
    torch.argmax (a compare that ordered -0.0 below +0.0 would answer 900)."""
    w, packed = head(11)
    x = torch.randn(20, HIDDEN)
    nan_w = w.clone()
    nan_w[613, 3] = float("nan")
    nan_packed = PackedWeight(None, pack_bf16(nan_w), bf16_routes=DOT)
    zero_w = w.clone()
    zero_w[100], zero_w[900] = -0.0, 0.0  # 0 x -0.0 = -0.0 keeps the bias's sign; 0 x +0.0 = +0.0
    zero_packed = PackedWeight(None, pack_bf16(zero_w), bf16_routes=DOT)
    bias = torch.full((VOCAB,), float("-inf"))
    bias[100], bias[900] = -0.0, 0.0
    zeros = torch.zeros(5, HIDDEN)
    logits = linear(zeros, zero_w, bias, zero_packed)
    assert logits[:, 100].signbit().all() and not logits[:, 900].signbit().any()
    with torch_threads(threads):
        assert (logits_argmax(x, nan_w, nan_packed) == 613).all()
        assert torch.equal(argmax_dot(x, None, nan_packed), logits_argmax(x, nan_w, nan_packed))
        assert (logits_argmax(zeros, zero_w, zero_packed, bias) == 100).all()
        assert torch.equal(argmax_dot(zeros, bias, zero_packed), logits_argmax(zeros, zero_w, zero_packed, bias))


@pytest.mark.parametrize("vocab", [1, 15, 17, 47])
def test_heads_narrower_than_a_panel(vocab):
    """Part of one panel, every logit negative: the lanes past the head's
    columns (-inf) never win."""
    w = -(torch.randn(vocab, HIDDEN) / HIDDEN**0.5).abs().to(torch.bfloat16)
    packed = PackedWeight(None, pack_bf16(w), bf16_routes=DOT)
    x = torch.randn(33, HIDDEN).abs()
    assert torch.equal(argmax_dot(x, None, packed), logits_argmax(x, w, packed))


def test_bad_shapes_and_an_allocation_failure_are_refused():
    """-3 for no rows' worth of columns or negative rows (nothing written),
    0 rows answer nothing, and bests too large to allocate answer -5."""
    k = packed_linear.kernel()
    out = torch.full((4,), -7, dtype=torch.int64)
    args = (out.data_ptr(), None, HIDDEN, None, None)
    assert k.gemm_bf16_dot_argmax(*args, 4, 0, HIDDEN, 0, 2) == -3
    assert k.gemm_bf16_dot_argmax(*args, -1, 48, HIDDEN, 0, 2) == -3
    assert k.gemm_bf16_dot_argmax(*args, 0, 48, HIDDEN, 0, 2) == 0
    assert (out == -7).all()
    assert k.gemm_bf16_dot_argmax(None, None, 64, None, None, 1 << 30, 1000, 64, 0, 1 << 20) == -5


def test_other_routes_decline():
    """Only the dot route's logits can be reduced on its tiles: None elsewhere,
    so the caller computes the logits."""
    w, packed = head(1)
    x = torch.randn(4, HIDDEN)
    assert argmax_dot(x, None, replace(packed, bf16_routes=((1, "blocks"),))) is None
    assert argmax_dot(x, None, None) is None


GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize(
    "params,fused",
    [
        ([GREEDY] * 3, True),
        ([GREEDY, SamplingParams(temperature=0.0, logprobs=2), GREEDY], False),  # logprobs need the logits
        ([GREEDY, SamplingParams(temperature=0.8, seed=3), GREEDY], False),
        ([GREEDY, SamplingParams(temperature=0.0, repetition_penalty=1.3), GREEDY], False),
        ([GREEDY, SamplingParams(temperature=0.0, logit_bias=((7, 100.0),)), GREEDY], False),  # a logit edit
    ],
    ids=["all-greedy", "logprobs", "random-row", "penalty", "logit-bias"],
)
def test_the_runner_takes_the_head_argmax_only_for_plain_greedy_steps(tiny_gguf, params, fused, monkeypatch):
    """A bf16 model whose head takes the dot route: steps whose rows are all
    plain greedy take argmax_dot, the others the sampler over the logits; the
    tokens are those of the logits' path either way."""
    from executor_svc.attention import get_backend
    from executor_svc.kv_cache import allocate_kv_caches
    from executor_svc.model_loader import load_model
    from executor_svc.model_runner import ModelRunner
    from tests.plan_driver import Job, PlanDriver

    backend = get_backend("cpu")
    loaded = load_model(
        tiny_gguf, torch.bfloat16, "cpu", backend, with_tokenizer=False, packed_gemm=True, gguf_blocks=True
    )
    model = loaded.model
    model._head_packed = replace(model._head_packed, bf16_routes=DOT)
    gen = torch.Generator().manual_seed(4)
    work = [
        Job(f"r{i}", torch.randint(3, loaded.config.vocab_size, (n,), generator=gen).tolist(), 8, p)
        for i, (n, p) in enumerate(zip((9, 30, 17), params))
    ]
    taken = []
    monkeypatch.setattr(
        "executor_svc.model.argmax_dot", lambda *a: taken.append(gemm_epilogues.argmax_dot(*a)) or taken[-1]
    )
    outs = []
    for greedy_tokens in (model.greedy_tokens, lambda h: argmax(model.compute_logits(h))):
        model.greedy_tokens = greedy_tokens
        kv = allocate_kv_caches(loaded.config, 200, 16, torch.bfloat16, torch.device("cpu"))
        runner = ModelRunner(model, kv, 16, loaded.config.vocab_size, torch.device("cpu"), backend)
        out = PlanDriver(runner, 16).run(work)
        outs.append({rid: o.tokens for rid, o in out.items()})
    assert outs[0] == outs[1]
    if fused:
        assert taken and all(t is not None for t in taken), "greedy steps computed their logits"
    else:
        assert not taken, "a step that needs its logits went without them"
