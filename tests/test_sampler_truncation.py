"""Truncation's shortcuts in the sampler: the race among each row's leading
tokens (top_p.FIRST_CANDIDATES, or its top_k) where they hold every token
that survives top-k/top-p/min-p, the whole-row race where they do not, and
top-p's tiers (leading tokens, top_p.CANDIDATES, the full sort). A seeded row
must draw the same token on every path, whatever its batch.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import executor_svc.top_p as top_p_module
from executor_svc.sampler import Sampler, build_sampling_metadata
from shared.sampling_params import SamplingParams
from tests.test_sampler import N_DRAWS, assert_distribution, sample


def whole_row(md):
    """The same metadata, made to race every token of every row (the path of
    batches where some random row does not truncate)."""
    return dataclasses.replace(md, every_random_row_truncated=False)


@pytest.mark.parametrize("first, candidates", [(16, 64), (256, 4096)])
def test_leading_race_picks_the_whole_row_race_token_for_seeded_rows(first, candidates, monkeypatch):
    # Rows whose truncation fits in the leading `first` tokens race those only;
    # the others (a nucleus longer than `first`) race the whole row: either way
    # a seeded row draws the token the whole-row race draws. With (16, 64),
    # top-p's nuclei also go through the middle tier (16 -> 64 -> full sort).
    monkeypatch.setattr(top_p_module, "FIRST_CANDIDATES", first)
    monkeypatch.setattr(top_p_module, "CANDIDATES", candidates)
    vocab, rows = 3000, 400
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(rows, vocab, generator=gen) * torch.linspace(0.5, 6.0, rows)[:, None]
    shapes = [
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=40),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.8),
        SamplingParams(temperature=1.2, top_p=0.99, min_p=0.01),
    ]
    params = [dataclasses.replace(shapes[i % 4], seed=i) for i in range(rows)]
    md = build_sampling_metadata(params, [[]] * rows, [[1] * (i % 3) for i in range(rows)], vocab, "cpu")
    assert md.every_random_row_truncated
    leading = Sampler()(logits, md).sampled_token_ids
    whole = Sampler()(logits, whole_row(md)).sampled_token_ids
    assert torch.equal(leading, whole)


def test_leading_race_keeps_ties_beyond_the_leading_tokens(monkeypatch):
    # 40 tokens tie for the largest logit and top_k=2 keeps every tie: more
    # than the 16 leading tokens, so the race must look beyond them.
    monkeypatch.setattr(top_p_module, "FIRST_CANDIDATES", 16)
    vocab, rows = 200, 8000
    logits = torch.full((vocab,), -5.0)
    tied = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:40]
    logits[tied] = 3.0
    torch.manual_seed(0)
    tokens = sample([SamplingParams(top_k=2)] * rows, logits.expand(rows, -1).contiguous()).sampled_token_ids
    expected = torch.zeros(vocab)
    expected[tied] = 1.0
    assert_distribution(tokens, expected)


def test_leading_race_draws_the_truncated_target_with_the_global_generator(monkeypatch):
    # Unseeded rows draw from torch's generator on either path: a batch split
    # between a nucleus of 3 (within the 16 leading tokens of 64) and one of
    # 30 (beyond them: the whole-row race) draws each target distribution.
    monkeypatch.setattr(top_p_module, "FIRST_CANDIDATES", 16)
    paths = {"leading": 0, "whole": 0}
    for name, attr in (("leading", "_race_leading"), ("whole", "_race_whole_rows")):
        real = getattr(Sampler, attr)

        def counted(self, *args, _real=real, _name=name):
            paths[_name] += 1
            return _real(self, *args)

        monkeypatch.setattr(Sampler, attr, counted)
    gen = torch.Generator().manual_seed(7)
    probs = torch.rand(64, generator=gen, dtype=torch.float64) ** 3 + 1e-3
    probs /= probs.sum()
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]

    def nucleus(n):  # top_p halfway between the masses before ranks n - 1 and n: ranks 0..n-1
        target = torch.zeros_like(probs)
        target[order[:n]] = probs[order[:n]]
        return SamplingParams(top_p=float(before[n - 1] + before[n]) / 2), target

    (short, short_target), (long, long_target) = nucleus(3), nucleus(30)
    half = N_DRAWS // 2
    torch.manual_seed(3)
    logits = probs.log().float().expand(2 * half, -1).contiguous()
    tokens = sample([short] * half + [long] * half, logits).sampled_token_ids
    assert paths == {"leading": 1, "whole": 1}
    assert_distribution(tokens[:half], short_target)
    assert_distribution(tokens[half:], long_target)


def test_top_k_top_p_row_draws_the_same_token_whatever_its_batch():
    # top-p's sum over a top-k'd row is taken over its leading tokens where
    # they hold every survivor; that choice must not depend on whether the
    # other rows truncate (the leading path) or not (the whole-row path).
    # Find a row where summing over the whole masked row and over its 256
    # leading tokens differ in the last bits, and a top_p on a mass before
    # some rank that the difference moves: the nucleus then depends on the sum.
    vocab, k = 4096, 40
    x = torch.randn(200, vocab, generator=torch.Generator().manual_seed(0)) * 3
    found = None
    for r in range(x.shape[0]):
        row = x[r : r + 1]
        leading = row.topk(256, dim=-1).values
        floor = leading[:, k - 1 : k]
        whole = row.masked_fill(row < floor, -math.inf).logsumexp(-1, keepdim=True)
        first = leading.masked_fill(leading < floor, -math.inf).logsumexp(-1, keepdim=True)
        kept = leading[:, :k]
        before = [((kept - lse).exp().cumsum(-1) - (kept - lse).exp())[0] for lse in (whole, first)]
        moved = [i for i in range(1, k - 1) if before[0][i] != before[1][i]]
        if moved:
            found = row, float(max(before[0][moved[0]], before[1][moved[0]]))
            break
    assert found, "no row whose two sums differ: the test needs another seed"
    row, top_p = found
    untruncated = SamplingParams(temperature=1.0, seed=1)
    for seed in range(100):
        params = SamplingParams(temperature=1.0, top_k=k, top_p=top_p, seed=seed)
        alone = sample([params], row).sampled_token_ids[0].item()
        beside = sample([params, untruncated], torch.cat([row, row])).sampled_token_ids[0].item()
        assert alone == beside, f"seed {seed}: alone {alone}, beside an untruncated row {beside}"
