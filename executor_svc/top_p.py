"""Top-p's threshold: the smallest logit of each row's nucleus, found among the
row's best tokens by partial sorts (tiers of FIRST_CANDIDATES, CANDIDATES,
then the whole row) rather than a sort of every row. The sampler
(sampler.py) masks below it."""

from __future__ import annotations

import math

import torch

from executor_svc.row_ops import RowOps

# Top-p looks for the nucleus among each row's this many most likely tokens and
# sorts the whole row only when they hold less than top_p of the mass.
CANDIDATES = 4096
# On CPU, a batch whose random rows all truncate (top-k or top-p) first takes
# each row's this many best tokens (or its top_k, if more): top-p's nucleus
# usually lies among them, and the race then draws noise for them alone.
# Over a 49,152-token vocabulary at 64 rows (AMD EPYC, 2 threads) torch's
# topk(256) took 6.7 ms against 23 ms for topk(4096), and full-row noise 17 ms;
# the native top_k_rows (row_ops.py, RowOps.leading) takes 1.6-1.9 ms for topk(256).
FIRST_CANDIDATES = 256


def nucleus_threshold(sorted_desc: torch.Tensor, lse: torch.Tensor, top_p: torch.Tensor, ops: RowOps):
    """Smallest logit of each row's nucleus, given its leading sorted logits.

    Rank i (0 = most likely) belongs to the nucleus iff the mass of ranks < i is
    below p: the minimal set whose mass reaches p; rank 0 always belongs.
    Returns (threshold [R, 1], mass of the given ranks [R]).
    """
    probs = (sorted_desc - lse).exp()
    cumulative = ops.cumsum(probs)
    # At least rank 0, also where the mass is NaN (a row with no finite logit).
    n_keep = ((cumulative - probs) < top_p[:, None]).sum(dim=-1, keepdim=True).clamp_(min=1)
    return sorted_desc.gather(1, n_keep - 1), cumulative[:, -1]


def threshold(
    logits: torch.Tensor,
    top_p: torch.Tensor,
    ops: RowOps,
    floor: torch.Tensor | None = None,
    leading: torch.Tensor | None = None,
) -> torch.Tensor:
    """[R, 1] nucleus threshold per row (-inf where top_p = 1) of the logits after
    top-k: tokens below `floor` [R, 1] (each row's top-k threshold) are out.

    Usually the nucleus lies within the row's best tokens and a partial topk
    suffices: `leading` (the row's best tokens, at least FIRST_CANDIDATES of
    them, sorted, those below the floor at -inf, where the caller has them),
    else its CANDIDATES best. Rows
    whose nucleus is longer look among CANDIDATES, then sort in full.
    Prefix sums of a longer sorted prefix start with the shorter one's
    (torch's CPU cumsum runs along the row), so every tier finds the same
    threshold. A row whose top-k survivors all lie among its first
    FIRST_CANDIDATES leading tokens takes its logsumexp over those alone: over
    the whole row the -inf of every other token made torch's exp 2-3x slower;
    a slice's logsumexp does not depend on the tensor it is cut from. Which
    tier and which sum a row takes depends only on that row (and the fixed
    constants), so its result does too.
    """
    vocab_size = logits.shape[1]

    def top_k_d(rows: torch.Tensor | None) -> torch.Tensor:
        if rows is not None and rows.numel() == logits.shape[0]:
            rows = None  # every row: no copy
        x = logits if rows is None else logits[rows]
        return x if floor is None else x.masked_fill(x < (floor if rows is None else floor[rows]), -math.inf)

    if leading is None:
        leading = ops.leading(top_k_d(None), min(vocab_size, max(CANDIDATES, FIRST_CANDIDATES)))[0]
    if floor is None or logits.device.type != "cpu":
        # (CUDA keeps the whole-row sum: its rows never take the leading path.)
        lse = ops.logsumexp(top_k_d(None))
    else:
        # The same sum for a row whichever caller built `leading` (whether the
        # rest of its batch truncates or not): over its first FIRST_CANDIDATES
        # sorted tokens where every survivor lies among them, else the whole row.
        first = leading[:, : min(FIRST_CANDIDATES, vocab_size)]
        lse = ops.logsumexp(first)
        if first.shape[1] < vocab_size:
            # Tokens beyond the first are <= first[:, -1]: all below the floor iff it is above that.
            outside = (floor <= first[:, -1:]).squeeze(1).nonzero().squeeze(1)  # host sync
            if outside.numel():
                lse[outside] = ops.logsumexp(top_k_d(outside))
    threshold, mass = nucleus_threshold(leading, lse, top_p, ops)
    width = leading.shape[1]
    while width < vocab_size:
        short = ((mass < top_p) & (top_p < 1.0)).nonzero().squeeze(1)  # host sync
        if not short.numel():
            break
        width = min(CANDIDATES, vocab_size) if width < CANDIDATES else vocab_size
        rows = top_k_d(short)
        # The whole row too through ops.leading: the same values as torch's sort, and on CPU
        # natively ~10x faster (64 x 49,152: 11.9 ms against 113 ms for torch's sort).
        longer = ops.leading(rows, width)[0]
        threshold[short], mass[short] = nucleus_threshold(longer, lse[short], top_p[short], ops)
    # top_p = 1 keeps everything even where rounding pushes the cumsum past 1.
    return threshold.masked_fill((top_p >= 1.0)[:, None], -math.inf)
