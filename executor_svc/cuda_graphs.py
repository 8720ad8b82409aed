"""Decode steps replayed from CUDA graphs (CUDA, Triton attention).

A decode step launches some 30 kernels a layer. On an H200 the 30 layers of
a SmolLM2-135M-shaped model took 16 ms of CPU time to launch while the GPU
was busy for 2.4 ms of it, whatever the batch (1, 64 or 256 requests): the
step was bound by launches, not by the GPU (docs/optimization_log.md, "The
first run on a GPU"). A CUDA graph replays a captured sequence of launches
in one call.

One graph per padded batch size (1, 2, 4, 8, then multiples of 16 up to
max_num_seqs), captured when the runner is built, over static input buffers
that every graph shares, largest first so that all draw on one memory pool.
A decode-only step of B requests copies its inputs into the first B rows of
the buffers, pads the rows up to the captured size with requests that write
and read only the null block (block 0, which no request owns), replays the
graph and returns the first B rows of its output. Prefills, mixed steps and
batches larger than the largest graph run eagerly.

What a replay depends on must live on the device, at a fixed address: the
Triton attention kernel reads lengths and block tables from device tensors
and its grid is one program per request (fixed per size), so it qualifies;
the torch backend plans on the host and does not (the worker captures only
over Triton attention). A block table in the static buffer may hold stale
ids past a row's own blocks: attention never reads past a row's seq_len.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor_svc.attention.metadata import AttentionMetadata

NULL_SLOT = 0  # slot 0 of the null block: where the padding rows' keys and values go


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The captured sizes: powers of two up to 8, then multiples of 16 to cover max_batch."""
    assert max_batch >= 1
    small = [s for s in (1, 2, 4, 8) if s < max_batch]
    return small + list(range(16, -(-max_batch // 16) * 16 + 1, 16)) if max_batch > 8 else small + [max_batch]


Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class DecodeGraphs:
    """Captured decode forwards by padded batch size; `replay` runs a step through one."""

    def __init__(
        self,
        forward: Forward,
        prepare: Callable[[AttentionMetadata], None],
        max_batch: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.sizes = graph_batch_sizes(max_batch)
        self.block_size = block_size
        m = self.sizes[-1]
        # Every row starts as padding: one token at position 0 in the null block.
        self.input_ids = torch.zeros(m, dtype=torch.int64, device=device)
        self.positions = torch.zeros(m, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((m,), NULL_SLOT, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(m, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(m + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(m, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.metas: dict[int, AttentionMetadata] = {}  # alive as long as the graphs that read them
        self.runs: dict[int, Callable[[], torch.Tensor]] = {}
        pool = None
        for size in reversed(self.sizes):
            meta = self._meta(size)
            prepare(meta)  # the backend's per-step tensors, fixed for a decode of this size
            self.metas[size] = meta
            self.runs[size], pool = self._capture(forward, size, meta, pool)

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_tokens=size,
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            max_query_len=1,
            max_seq_len=1,
            block_size=self.block_size,
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[1] * size,
        )

    def _capture(self, forward: Forward, size: int, meta: AttentionMetadata, pool):
        """(replay, memory pool): one eager run first (Triton compiles, cuBLAS sets up), then the capture."""
        ids, pos = self.input_ids[:size], self.positions[:size]
        forward(ids, pos, meta)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward(ids, pos, meta)

        def run() -> torch.Tensor:
            graph.replay()
            return out

        return run, graph.pool()

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The step's hidden states [B, hidden] from a graph, or None where no graph fits
        (not every request decoding one token, more requests or wider block tables than captured).
        The result is the graph's output buffer: valid until the next replay."""
        b = meta.num_seqs
        width = meta.block_tables.shape[1]
        if meta.max_query_len != 1 or meta.num_tokens != b or b > self.sizes[-1] or width > self.block_tables.shape[1]:
            return None
        size = next(s for s in self.sizes if s >= b)
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.seq_lens[:b].copy_(meta.seq_lens)
        self.block_tables[:b, :width].copy_(meta.block_tables)
        if size > b:
            # Rows a previous, larger step left behind become padding again.
            self.slot_mapping[b:size].fill_(NULL_SLOT)
            self.seq_lens[b:size].fill_(1)
            self.block_tables[b:size, 0].zero_()
        return self.runs[size]()[:b]
