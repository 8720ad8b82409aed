"""How a step's query tokens become the CPU attention kernels' work items,
once per step (CpuAttentionBackend.prepare) and shared by every layer.

Decodes (one query token) are items of `native/paged_decode.c`: the token's
row, its request's block-table row, its length.

Prefill work items, for request r with q new tokens and seq_len L
(query rows starts[r] .., positions L - q ..):

    item k:  query rows starts[r] + 16k .. + count - 1     count = min(16, q - 16k)
             positions  L - q + 16k ..                     attends to 0 .. its own

Batch invariance (`batch_invariant`, --deterministic): the two kernels sum
q.k in different orders (decode: 16 lanes of d, then a tree; prefill: d in
sequence), so a token's attention would depend on whether it was decoded or
recomputed in a prefill chunk. In this mode every query token, prefill ones
included, is one item of the decode kernel, with its own length (position +
1) and its request's block-table row: each token then attends in one fixed
order, key chunks of 16 from position 0 with an online softmax, whatever
the batch, the chunking or the thread count (the kernel's split of work
across threads never splits a head's sums).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_svc.attention.metadata import AttentionMetadata


@dataclass
class Decodes:
    tokens: torch.Tensor  # [n] int64, query token of each decode
    seq_index: torch.Tensor  # [n] int32, its row in block_tables / seq_lens
    max_seq_len: int
    # Per-token rows (batch-invariant mode): each item's own block-table row
    # and length; None = the step's meta.block_tables and meta.seq_lens.
    block_tables: torch.Tensor | None = None  # [n, max blocks] int32
    seq_lens: torch.Tensor | None = None  # [n] int32


@dataclass
class PrefillItems:
    token: torch.Tensor  # [n] int64, first query row
    count: torch.Tensor  # [n] int32, query tokens (<= the kernel's tokens_per_item)
    pos: torch.Tensor  # [n] int32, position of the first
    seq_index: torch.Tensor  # [n] int32, the request's row in block_tables
    rows: torch.Tensor  # [num prefill tokens] int64, every prefill query row


@dataclass
class CpuStepLayout:
    decodes: Decodes | None
    has_prefills: bool
    prefills: PrefillItems | None  # None without a native prefill kernel: SDPA


def plan_step(meta: AttentionMetadata, batch_invariant: bool, tokens_per_item: int | None) -> CpuStepLayout:
    """The step's work items, for metadata that check_metadata accepted;
    `tokens_per_item` of the prefill kernel, None where there is none (its
    prefills then go to SDPA)."""
    if batch_invariant:
        return CpuStepLayout(every_token_decodes(meta), False, None)
    if len(meta.query_lens_cpu) == meta.num_tokens:
        # Decodes only (every query length is >= 1 and they sum to num_tokens:
        # check_metadata): item i is query row i of request row i.
        tokens = torch.arange(meta.num_tokens, dtype=torch.int64)
        return CpuStepLayout(Decodes(tokens, tokens.to(torch.int32), max(meta.seq_lens_cpu)), False, None)
    rows = [i for i, q in enumerate(meta.query_lens_cpu) if q == 1]
    decodes = None
    if rows:
        index = torch.tensor(rows, dtype=torch.int64)
        decodes = Decodes(
            tokens=meta.query_start_loc[index].to(torch.int64).contiguous(),
            seq_index=index.to(torch.int32),
            max_seq_len=max(meta.seq_lens_cpu[i] for i in rows),
        )
    has_prefills = len(rows) < len(meta.query_lens_cpu)
    prefills = None
    if has_prefills and tokens_per_item is not None:
        prefills = prefill_items(meta, tokens_per_item)
    return CpuStepLayout(decodes, has_prefills, prefills)


def every_token_decodes(meta: AttentionMetadata) -> Decodes:
    """Every query token of the step as a decode item of its own (batch-invariant
    mode): token i of request r, at position p, reads r's block-table row and
    p + 1 keys."""
    query_lens = torch.tensor(meta.query_lens_cpu, dtype=torch.int64)
    seq_lens = torch.tensor(meta.seq_lens_cpu, dtype=torch.int64)
    row = torch.repeat_interleave(torch.arange(len(meta.query_lens_cpu)), query_lens)
    starts = torch.cumsum(query_lens, 0) - query_lens
    token = torch.arange(meta.num_tokens, dtype=torch.int64)
    lengths = seq_lens[row] - query_lens[row] + (token - starts[row]) + 1
    tables = meta.block_tables if meta.block_tables.dtype == torch.int32 else meta.block_tables.to(torch.int32)
    return Decodes(
        tokens=token,
        seq_index=torch.arange(meta.num_tokens, dtype=torch.int32),
        max_seq_len=max(meta.seq_lens_cpu),
        block_tables=tables.index_select(0, row).contiguous(),
        seq_lens=lengths.to(torch.int32),
    )


def prefill_items(meta: AttentionMetadata, n: int) -> PrefillItems:
    """Work items of up to n (16) query tokens over every prefill of the step
    (see the module docstring), latest positions first so the dynamic
    schedule ends on the cheapest items."""
    token, count, pos, seq = [], [], [], []
    starts = meta.query_start_loc.tolist()
    for r, (q, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if q == 1:
            continue
        for k in range(0, q, n):
            token.append(starts[r] + k)
            count.append(min(n, q - k))
            pos.append(seq_len - q + k)
            seq.append(r)
    order = sorted(range(len(token)), key=lambda i: -pos[i])
    rows = [starts[r] + j for r, q in enumerate(meta.query_lens_cpu) if q > 1 for j in range(q)]
    return PrefillItems(
        token=torch.tensor([token[i] for i in order], dtype=torch.int64),
        count=torch.tensor([count[i] for i in order], dtype=torch.int32),
        pos=torch.tensor([pos[i] for i in order], dtype=torch.int32),
        seq_index=torch.tensor([seq[i] for i in order], dtype=torch.int32),
        rows=torch.tensor(rows, dtype=torch.int64),
    )
