"""The batched sampler: distributions, seeded reproducibility, penalties, logprobs.

Distribution checks sample many independent rows in one batch and compare the
empirical frequencies with the exact target distribution by a chi-square bound
(about a 1e-6 false-alarm rate), and require exact zeros outside the support.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import executor_svc.top_p as top_p_module
from executor_svc import fused_ops
from executor_svc.row_ops import RowOps
from executor_svc.sampler import Sampler, apply_min_tokens_and_penalties, build_sampling_metadata
from executor_svc.seeded_noise import seeded_uniform, uniform_from_keys, vocab_keys
from shared.sampling_params import SamplingParams

# Distinct probabilities, deliberately not in token order, so sorted rank != id.
#              rank:  4      0     6      2     5     1     7      3
PROBS = torch.tensor([0.05, 0.40, 0.015, 0.15, 0.03, 0.25, 0.005, 0.10])
LOGITS = PROBS.log()
N_DRAWS = 20000


def sample(params, logits, prompts=None, outputs=None, sampler=None):
    n = len(params)
    md = build_sampling_metadata(
        params, prompts or [[] for _ in range(n)], outputs or [[] for _ in range(n)], logits.shape[1], "cpu"
    )
    return (sampler or Sampler())(logits, md)


def assert_distribution(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    counts = torch.bincount(tokens, minlength=expected.numel()).double()
    zero = expected == 0
    assert counts[zero].sum() == 0, f"sampled outside the support: counts {counts.tolist()}"
    exp_counts = expected[~zero].double() / expected.sum() * tokens.numel()
    chi2 = float(((counts[~zero] - exp_counts) ** 2 / exp_counts).sum())
    df = int((~zero).sum()) - 1
    bound = df + 8 * math.sqrt(2 * df) + 8
    assert chi2 < bound, f"chi2 {chi2:.1f} >= {bound:.1f}: counts {counts.tolist()} vs {exp_counts.tolist()}"


def draw(params: SamplingParams, noise: str) -> torch.Tensor:
    """N_DRAWS independent draws from LOGITS, by the noise source under test.

    "global": unseeded rows; "seeds": seeds 0..N-1 at position 0; "positions":
    seed 7 at positions 0..N-1 (one request's successive draws).
    """
    torch.manual_seed(1234)
    seeds = {"global": [None] * N_DRAWS, "seeds": range(N_DRAWS), "positions": [7] * N_DRAWS}[noise]
    rows = [dataclasses.replace(params, seed=s) for s in seeds]
    md = build_sampling_metadata(rows, [[]] * N_DRAWS, [[]] * N_DRAWS, LOGITS.numel(), "cpu")
    if noise == "positions":  # as if row i had i outputs, without building those lists
        md.seed_positions = torch.arange(N_DRAWS)
    return Sampler()(LOGITS.expand(N_DRAWS, -1).contiguous(), md).sampled_token_ids


def keep(ids: list[int]) -> torch.Tensor:
    mask = torch.zeros_like(PROBS)
    mask[ids] = 1
    return PROBS * mask


@pytest.mark.parametrize("noise", ["global", "seeds", "positions"])
@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(temperature=1.0), PROBS),
        (SamplingParams(temperature=0.5), PROBS**2),
        (SamplingParams(temperature=2.0), PROBS**0.5),
        (SamplingParams(top_k=3), keep([1, 5, 3])),
        # Mass before each rank: 0, .40, .65: the nucleus for 0.6 is ranks 0-1, for 0.7 ranks 0-2.
        (SamplingParams(top_p=0.6), keep([1, 5])),
        (SamplingParams(top_p=0.7), keep([1, 5, 3])),
        # top-p sees the top-k-renormalised mass: .40/.90 + .25/.90 = .72 >= .7, so rank 2 goes.
        (SamplingParams(top_k=4, top_p=0.7), keep([1, 5])),
        # min_p 0.2 of the largest (0.40) keeps p >= 0.08.
        (SamplingParams(min_p=0.2), keep([1, 5, 3, 7])),
        # min_p applies to the tempered distribution (as vLLM): at T=0.5 the ratio
        # to the largest is squared, (.15/.40)**2 = .14 < .2, so token 3 goes too.
        (SamplingParams(temperature=0.5, min_p=0.2), keep([1, 5]) ** 2),
    ],
    ids=["t1", "t0.5", "t2", "topk3", "topp0.6", "topp0.7", "topk4-topp0.7", "minp0.2", "t0.5-minp0.2"],
)
def test_sampled_distribution_matches_the_truncated_target(params, expected, noise):
    assert_distribution(draw(params, noise), expected)


def test_per_row_top_k_in_one_batch():
    torch.manual_seed(0)
    ks = [1, 2, 5, 0]
    params = [SamplingParams(top_k=k) for k in ks for _ in range(4000)]
    tokens = sample(params, LOGITS.expand(len(params), -1).contiguous()).sampled_token_ids.view(4, -1)
    order = [1, 5, 3, 7, 0, 4, 2, 6]  # token ids, most likely first
    for row, k in zip(tokens, ks):
        assert_distribution(row, keep(order[:k]) if k else PROBS)


@pytest.mark.parametrize("seeded", [False, True], ids=["global-rng", "seeded-hash"])
def test_top_p_nucleus_larger_than_the_candidate_set(seeded, monkeypatch):
    # Top-p looks among a row's best top_p.CANDIDATES tokens first (shrunk to
    # 256 here to keep the test small). 2000 near-flat tokens with a ~0.9
    # nucleus of 1501: the sampler must fall back to a full sort.
    monkeypatch.setattr(top_p_module, "CANDIDATES", 256)
    vocab, rows = 4096, 512
    gen = torch.Generator().manual_seed(0)
    by_rank = torch.cat([-1e-3 * torch.arange(2000.0), torch.full((vocab - 2000,), -30.0)])
    ids = torch.randperm(vocab, generator=gen)  # rank r is token ids[r]
    logits = torch.empty(vocab).index_put_((ids,), by_rank)
    probs = by_rank.double().softmax(dim=0)
    mass_before = probs.cumsum(dim=0) - probs
    # top_p halfway between two cumulative masses: the nucleus is ranks 0..1500.
    nucleus = 1501
    top_p = float(mass_before[nucleus - 1] + mass_before[nucleus]) / 2
    torch.manual_seed(0)
    params = [SamplingParams(top_p=top_p, seed=i if seeded else None) for i in range(rows)]
    tokens = sample(params, logits.expand(rows, -1).contiguous()).sampled_token_ids
    ranks = torch.argsort(ids)[tokens]
    assert int(ranks.max()) < nucleus, "sampled outside the nucleus"
    assert int((ranks >= nucleus - 100).sum()) > 0, "the nucleus lost its tail"  # ~15 expected
    # Ranks 256..1500 hold ~67% of the nucleus mass.
    assert int((ranks >= 256).sum()) > rows // 2, "the nucleus was cut at the candidate set"


def test_native_seeded_uniform_is_the_torch_ops_bit_for_bit():
    # Whole rows (a width with a tail past the 16-lane vectors) and gathered tokens per row,
    # row keys up to 2**32 - 1.
    vocab = 1000
    keys = vocab_keys(vocab, "cpu")
    gen = torch.Generator().manual_seed(5)
    row = torch.cat([torch.randint(0, 1 << 32, (6,), generator=gen), torch.tensor([0, (1 << 32) - 1])])
    ids = torch.randint(0, vocab, (8, 37), generator=gen)
    for token_keys in (keys, keys[ids]):
        native = fused_ops.seeded_uniform_rows(row, token_keys)
        if native is None:
            pytest.skip("no native fused ops on this CPU")
        assert torch.equal(native, uniform_from_keys(row, token_keys))


def test_hash_noise_is_uniform_and_independent():
    vocab = 4096
    keys = vocab_keys(vocab, "cpu")
    seeds = torch.arange(32, dtype=torch.int64).repeat_interleave(8)  # 32 seeds x positions 0..7
    positions = torch.arange(8, dtype=torch.int64).repeat(32)
    u = seeded_uniform(seeds, torch.zeros_like(seeds), positions, keys).double()
    assert 0 < u.min() and u.max() < 1
    n = u.numel()
    bins = torch.bincount((u * 64).long().flatten(), minlength=64).double()
    chi2 = float(((bins - n / 64) ** 2 / (n / 64)).sum())
    assert chi2 < 63 + 8 * math.sqrt(126), f"uniformity chi2 {chi2:.1f}"

    def corr(a, b):
        a, b = a.flatten() - 0.5, b.flatten() - 0.5
        return float((a * b).mean() / (a.std() * b.std()))

    grid = u.view(32, 8, vocab)
    tol = 6 / math.sqrt(grid[:, 1:].numel())
    assert abs(corr(grid[:, 1:], grid[:, :-1])) < tol, "adjacent positions correlate"
    assert abs(corr(grid[1:], grid[:-1])) < 2 * tol, "adjacent seeds correlate"
    assert abs(corr(grid[..., 1:], grid[..., :-1])) < tol, "adjacent tokens correlate"
    # Pairs of adjacent positions fill an 8x8 grid evenly (catches dependence a correlation misses).
    cells = (grid[:, 1:] * 8).long() * 8 + (grid[:, :-1] * 8).long()
    m = cells.numel()
    pair_bins = torch.bincount(cells.flatten(), minlength=64).double()
    chi2 = float(((pair_bins - m / 64) ** 2 / (m / 64)).sum())
    assert chi2 < 63 + 8 * math.sqrt(126), f"pair chi2 {chi2:.1f}"
    # The seed's high 32 bits matter too.
    hi = seeded_uniform(seeds, torch.ones_like(seeds), positions, keys).double()
    assert abs(corr(hi, u)) < tol


def test_seeded_token_depends_only_on_seed_and_position():
    vocab = 1000
    torch.manual_seed(0)
    row = torch.randn(vocab) * 0.5  # flat: distinct seeds should pick distinct tokens
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=42)
    history = list(range(7))  # output position 7
    alone = sample([target], row[None], outputs=[history]).sampled_token_ids.item()

    others = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, seed=3),
        SamplingParams(temperature=1.3, top_k=5),
    ]
    for before, after in [(others, []), ([], others), (others[:2], others[2:]), (others * 3, others)]:
        params = before + [target] + after
        logits = torch.randn(len(params), vocab)
        logits[len(before)] = row
        outputs = [[1] * (i % 5) for i in range(len(params))]
        outputs[len(before)] = history
        torch.manual_seed(len(params))  # the global generator's state must not matter
        got = sample(params, logits, outputs=outputs).sampled_token_ids[len(before)].item()
        assert got == alone, f"batch of {len(params)} with the row at {len(before)} drew {got}, alone {alone}"

    by_seed = {
        sample([SamplingParams(temperature=1.0, seed=s)], row[None], outputs=[history]).sampled_token_ids.item()
        for s in range(20)
    }
    by_position = {
        sample([SamplingParams(temperature=1.0, seed=42)], row[None], outputs=[[0] * pos]).sampled_token_ids.item()
        for pos in range(20)
    }
    by_high_bits = {
        sample([SamplingParams(temperature=1.0, seed=42 + (s << 32))], row[None]).sampled_token_ids.item()
        for s in range(20)
    }
    assert min(len(by_seed), len(by_position), len(by_high_bits)) >= 15, (by_seed, by_position, by_high_bits)


def test_penalties_match_a_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)]
    md = build_sampling_metadata(params, [[0, 1, 0]], [[1, 2, 2]], 6, "cpu")
    got = apply_min_tokens_and_penalties(logits, md)
    # Repetition on {0, 1, 2} (prompt or output): positive / 2, negative * 2.
    # Then output counts {1: 1, 2: 2}: minus 0.25 * count, minus 0.5 once.
    expected = torch.tensor([[1.0, -2.0 - 0.25 - 0.5, 0.25 - 0.5 - 0.5, -0.5, 3.0, 0.0]])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0]])), "input modified"

    # Presence/frequency ignore prompt-only tokens; repetition alone leaves unseen tokens.
    md = build_sampling_metadata([SamplingParams(presence_penalty=1.0)], [[4]], [[]], 6, "cpu")
    torch.testing.assert_close(apply_min_tokens_and_penalties(logits, md), logits)
    # End to end: greedy over the penalised logits.
    top = torch.tensor([[3.0, 2.9, 0.0]])
    assert sample([SamplingParams(temperature=0.0)], top).sampled_token_ids.item() == 0
    assert (
        sample([SamplingParams(temperature=0.0, repetition_penalty=1.2)], top, prompts=[[0]]).sampled_token_ids.item()
        == 1
    )


def test_min_tokens_masks_until_enough_outputs():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])  # token 1 (say EOS) is the argmax
    params = SamplingParams(temperature=0.0, min_tokens=2, min_tokens_masked_ids=(1, 2))
    assert sample([params], logits, outputs=[[3]]).sampled_token_ids.item() == 3
    assert sample([params], logits, outputs=[[3, 3]]).sampled_token_ids.item() == 1
    torch.manual_seed(0)
    random = [SamplingParams(temperature=1.0, min_tokens=1, min_tokens_masked_ids=(1,))] * 2000
    tokens = sample(random, logits.expand(2000, -1).contiguous()).sampled_token_ids
    assert_distribution(tokens, torch.tensor([0.0, 0.0, 4.0, 1.0]).exp() * torch.tensor([1, 0, 1, 1]))


def test_min_tokens_gives_way_where_it_would_leave_no_token():
    """Its stop ids cover every token the output constraint allows: the row
    samples as if min_tokens were met (here only tokens 1 and 2 are allowed,
    both stop ids), and the rows beside it are untouched."""
    allowed = torch.tensor([[-math.inf, 5.0, 4.0, -math.inf]])  # a constraint's mask already applied
    logits = torch.cat([allowed, torch.tensor([[0.0, 5.0, 4.0, 1.0]])])
    stuck = SamplingParams(temperature=0.0, min_tokens=3, min_tokens_masked_ids=(1, 2))
    out = sample([stuck, stuck], logits)
    assert out.sampled_token_ids.tolist() == [1, 3]  # row 1 still has token 3 outside its stop ids
    torch.manual_seed(0)
    random = dataclasses.replace(stuck, temperature=1.0, top_p=0.9)
    tokens = sample([random] * 2000, allowed.expand(2000, -1).contiguous()).sampled_token_ids
    assert_distribution(tokens, allowed[0].exp())


@pytest.mark.parametrize("top_p", [1.0, 0.5])
def test_overflowing_penalties_and_rows_of_nothing_sample_without_nan(top_p):
    """A repetition penalty near 0 divides positive logits past float32's
    range: they saturate, so the prompt's favoured tokens win, never NaN;
    and a row with no finite logit at all (nothing a constraint allows)
    draws some token instead of failing the batch."""
    logits = torch.tensor([[2.0, 1.0, -1.0, 3.0, 0.5], [-math.inf] * 5])
    params = [SamplingParams(temperature=0.9, top_p=top_p, repetition_penalty=1e-40), SamplingParams(top_p=top_p)]
    torch.manual_seed(0)
    for _ in range(20):
        # Token 1 (1.0, in the prompt) saturates far above token 3 (3.0); token 2 (-1.0) goes to -0.
        out = sample(params, logits, prompts=[[1, 2], []])
        assert out.sampled_token_ids[0].item() == 1
        assert 0 <= out.sampled_token_ids[1].item() < 5


def test_greedy_is_exactly_argmax():
    torch.manual_seed(0)
    logits = torch.randn(16, 1000)
    expected = logits.argmax(dim=-1)
    plain = sample([SamplingParams(temperature=0.0)] * 16, logits)
    assert torch.equal(plain.sampled_token_ids, expected)
    assert plain.logprobs == [None] * 16
    # Off the fast path (seed ignored, logprobs asked) the answer is the same.
    slow = sample([SamplingParams(temperature=0.0, seed=1, top_k=3, logprobs=2)] * 16, logits)
    assert torch.equal(slow.sampled_token_ids, expected)
    # A temperature too small to divide by safely samples greedily.
    tiny = sample([SamplingParams(temperature=1e-37)] * 16, logits * 1e3)
    assert torch.equal(tiny.sampled_token_ids, expected)
    assert sample([], torch.zeros(0, 1000)).sampled_token_ids.shape == (0,)


def test_top_logprobs_list_equal_values_by_token_id():
    # The native top_k_rows (CPU, AVX-512) orders ties by id; torch's topk leaves their order to its algorithm.
    logits = torch.tensor([[0.0, 1.0, 2.0, 1.0, 2.0, 0.5, 1.0]])
    if fused_ops.topk_rows(logits, 1) is None:
        pytest.skip("no native top_k_rows on this CPU")
    out = sample([SamplingParams(temperature=0.0, logprobs=4)], logits)
    assert [t for t, _ in out.logprobs[0].top] == [2, 4, 1, 3]
    assert [v for _, v in out.logprobs[0].top] == pytest.approx(logits.log_softmax(-1)[0, [2, 4, 1, 3]].tolist())


def test_logprobs_are_the_raw_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [
        SamplingParams(temperature=0.7, top_k=3, repetition_penalty=1.5, logprobs=5),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, logprobs=20, presence_penalty=2.0),
    ]
    out = sample(params, logits, prompts=[[1, 2], [], [], []], outputs=[[3], [], [], [4, 4]])
    raw = logits.log_softmax(dim=-1)
    tokens = out.sampled_token_ids.tolist()
    assert out.logprobs[2] is None
    for row, n in [(0, 5), (1, 0), (3, 20)]:
        lp = out.logprobs[row]
        assert lp.logprob == pytest.approx(raw[row, tokens[row]].item(), abs=1e-6)
        assert len(lp.top) == n
        want = raw[row].topk(n) if n else None
        if n:
            assert [t for t, _ in lp.top] == want.indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(want.values.tolist(), abs=1e-6)
            assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:])), "not most likely first"


def test_mixed_batch_rows_equal_rows_run_alone():
    torch.manual_seed(0)
    vocab = 300
    rows = [
        (SamplingParams(temperature=0.0), [5, 6], [7]),
        (SamplingParams(temperature=0.8, top_p=0.9, seed=11), [1], [2, 3]),
        (SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.2), [9, 9, 8], [8, 1]),
        (SamplingParams(temperature=1.1, top_k=20, presence_penalty=0.7, seed=12, logprobs=4), [3, 4], [4, 4, 5]),
        (SamplingParams(temperature=0.9, min_p=0.05, seed=13, min_tokens=5, min_tokens_masked_ids=(0, 1, 2)), [2], [1]),
        (SamplingParams(temperature=0.0, logprobs=3), [], []),
        (SamplingParams(temperature=1.0, top_k=7, top_p=0.8, seed=2**40 + 5), [0], []),
    ]
    logits = torch.randn(len(rows), vocab) * 2
    sampler = Sampler()

    def run(order):
        params, prompts, outputs = zip(*(rows[i] for i in order))
        return sample(list(params), logits[list(order)], list(prompts), list(outputs), sampler)

    alone = [run([i]) for i in range(len(rows))]
    for order in [list(range(len(rows))), list(reversed(range(len(rows)))), [3, 0, 6, 1, 5, 2, 4]]:
        out = run(order)
        for j, i in enumerate(order):
            assert out.sampled_token_ids[j].item() == alone[i].sampled_token_ids.item(), f"row {i} in {order}"
            assert out.logprobs[j] == alone[i].logprobs[0], f"row {i} logprobs in {order}"


def test_fast_path_and_input_untouched():
    torch.manual_seed(0)
    logits = torch.randn(3, 40)
    before = logits.clone()
    md = build_sampling_metadata([SamplingParams(temperature=0.0)] * 3, [[1]] * 3, [[2]] * 3, 40, "cpu")
    assert md.needs_only_argmax
    sample(
        [SamplingParams(temperature=0.5, repetition_penalty=2.0, min_tokens=3, min_tokens_masked_ids=(1,), top_p=0.5)]
        * 3,
        logits,
        [[1]] * 3,
        [[2]] * 3,
    )
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "bad",
    [
        SamplingParams(temperature=-1.0),
        SamplingParams(top_p=0.0),
        SamplingParams(min_p=1.5),
        SamplingParams(repetition_penalty=0.0),
        SamplingParams(logprobs=21),
        SamplingParams(min_tokens=1, min_tokens_masked_ids=(40,)),
    ],
)
def test_bad_params_raise(bad):
    with pytest.raises(ValueError):
        build_sampling_metadata([bad], [[]], [[]], 40, "cpu")


def test_bad_shapes_and_token_ids_raise():
    with pytest.raises(ValueError):
        build_sampling_metadata([SamplingParams()], [[], []], [[]], 40, "cpu")
    with pytest.raises(ValueError):
        build_sampling_metadata([SamplingParams(repetition_penalty=1.2)], [[40]], [[]], 40, "cpu")
    md = build_sampling_metadata([SamplingParams()], [[]], [[]], 40, "cpu")
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(1, 41), md)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_for_seeded_and_greedy_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, 49152) * 2
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(temperature=1.0, top_k=50, seed=2, repetition_penalty=1.2),
        SamplingParams(temperature=0.7, min_p=0.1, seed=3),
    ]
    prompts, outputs = [[1, 2]] * 4, [[3]] * 4
    cpu = sample(params, logits, prompts, outputs).sampled_token_ids
    md = build_sampling_metadata(params, prompts, outputs, 49152, "cuda")
    gpu = Sampler()(logits.cuda(), md).sampled_token_ids
    assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu)


@pytest.mark.parametrize("ops", [RowOps(), RowOps.torch_only()], ids=["native", "torch"])
def test_top_p_threshold_is_the_full_sorts_in_every_tier(ops, monkeypatch):
    # Rows whose nucleus lies within the first tier, within CANDIDATES, and
    # beyond both (near-flat rows, ties, -inf tokens): every tier must find
    # the threshold a sort of the whole row finds, the whole-row tier included
    # (it takes ops.leading at full width, not torch's sort).
    monkeypatch.setattr(top_p_module, "FIRST_CANDIDATES", 16)
    monkeypatch.setattr(top_p_module, "CANDIDATES", 256)
    vocab = 8192
    gen = torch.Generator().manual_seed(3)
    peaked = torch.randn(4, vocab, generator=gen) * 8
    flat = torch.randn(4, vocab, generator=gen) * 0.05
    tied = (torch.randn(4, vocab, generator=gen) * 4).round() / 4
    masked = (torch.randn(4, vocab, generator=gen)).masked_fill(torch.rand(4, vocab, generator=gen) < 0.5, -math.inf)
    logits = torch.cat([peaked, flat, tied, masked])
    top_p = torch.tensor([0.3, 0.9, 0.95, 0.999] * 4)
    got = top_p_module.threshold(logits, top_p, ops)
    ordered = logits.sort(dim=-1, descending=True).values
    want, _ = top_p_module.nucleus_threshold(ordered, ops.logsumexp(logits), top_p, ops)
    assert torch.equal(got, want)
    # The flat rows do need the whole row: their nucleus is longer than CANDIDATES.
    kept = (logits[4:8] >= got[4:8]).sum(dim=-1)
    assert int(kept.min()) > 256, kept
