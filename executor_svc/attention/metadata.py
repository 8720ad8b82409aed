"""Per-step attention inputs, built once by the model runner and shared by all layers.

For a batch of requests, their new (query) tokens are packed back to back:

    tokens:           [ r0: q q q q | r1: q | r2: q q ]
    query_start_loc:  [0, 4, 5, 7]
    seq_lens:         [ctx0 + 4, ctx1 + 1, ctx2 + 2]   (cached + new tokens)

Query token j of request i sits at absolute position seq_lens[i] - query_len[i] + j
and attends to positions 0..that position (causal). Its KV lives in slot
block_tables[i][pos // block_size] * block_size + pos % block_size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host-side copies for planning without device syncs.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Backend-private precomputation from prepare(), shared across layers.
    extra: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)
