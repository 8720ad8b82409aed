"""Steps replayed from CUDA graphs (CUDA, Triton attention).

A step launches some 30 kernels a layer. On an H200 the 30 layers of a
SmolLM2-135M-shaped model took 16 ms of CPU time to launch while the GPU was
busy for 2.4 ms of it, whatever the batch (1, 64 or 256 requests): the step
was bound by launches, not by the GPU (docs/optimization_log.md, "The first
run on a GPU"). A CUDA graph replays a captured sequence of launches in one
call. Two kinds are captured when the runner is built, over static input
buffers that all of them share, largest first so that all draw on one pool:

- decode graphs, one per padded batch size (1, 2, 4, 8, then multiples of 16
  up to max_num_seqs), for steps where every request computes one token: a
  step copies its inputs into the first B rows, pads up to the captured size
  with requests of one token that write and read only slot 0 of the null
  block (block 0, which no request owns), replays, and returns the first B
  rows of the output;
- mixed graphs, one per padded token count (16, 24, 32, 48, ... up to 512,
  then multiples of 256 up to max_num_batched_tokens or 2,048), for every
  other step: prefill chunks, alone or beside decodes. A busy server runs
  mostly these: once the first requests finish, each step admits a new
  request's chunk beside the running decodes. Padding tokens write the null
  block's slot 0 and belong to no request (their output rows are garbage,
  never read: every op but attention is row by row); padding requests have
  no query tokens and no context; the attention tiles past the step's own
  point at the last request row, which no step fills, so they load and
  store nothing.

A step runs eagerly where no graph fits it: more tokens than the largest
mixed graph (past ~2,048 a step's GPU time outweighs its launches), more
requests than the largest decode graph, or block tables wider than
max_model_len needs.

What a replay depends on must live on the device, at a fixed address: the
Triton attention kernel reads lengths, block tables, its tiles' requests and
first queries from device tensors, loops as far as those say, and its grid
is one program per tile (fixed per captured size), so it qualifies; the
torch backend plans on the host and does not (the worker captures only over
Triton attention). A block table in the static buffer may hold stale ids
past a row's own blocks: attention never reads past a row's seq_len.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor_svc.attention.metadata import AttentionMetadata

NULL_SLOT = 0  # slot 0 of the null block: where the padding tokens' keys and values go


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The decode graphs' sizes: powers of two up to 8, then multiples of 16 to cover max_batch."""
    assert max_batch >= 1
    small = [s for s in (1, 2, 4, 8) if s < max_batch]
    return small + list(range(16, -(-max_batch // 16) * 16 + 1, 16)) if max_batch > 8 else small + [max_batch]


MAX_GRAPH_TOKENS = 2048  # larger steps run eagerly: their GPU time, not their launches, is what they cost
_TOKEN_LADDER = [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, *range(768, MAX_GRAPH_TOKENS + 1, 256)]


def graph_token_sizes(max_tokens: int) -> list[int]:
    """The mixed graphs' token counts: 16, 24, 32, 48, ... (powers of two and 1.5 times them) up
    to 512, then multiples of 256, up to the first that holds min(max_tokens, 2048). Padding costs
    a small (launch-bound) step at most half its tokens again, a large one at most 255 tokens."""
    assert max_tokens >= 1
    cap = min(max_tokens, MAX_GRAPH_TOKENS)
    return [s for s in _TOKEN_LADDER if s < cap] + [next(s for s in _TOKEN_LADDER if s >= cap)]


Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class StepGraphs:
    """Captured forwards of decode and mixed steps; `replay` runs a step through one."""

    def __init__(
        self,
        forward: Forward,
        attention: str,
        max_batch: int,
        max_tokens: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.sizes = graph_batch_sizes(max_batch)
        self.token_sizes = graph_token_sizes(max_tokens)
        self.block_size = block_size
        self.attention = attention  # the Triton backend's name: its tiles are meta.extra[attention]
        m = max(self.sizes[-1], self.token_sizes[-1])
        # Request rows: as many as a decode graph has, and one more that is always padding.
        self.seq_rows = self.sizes[-1] + 1
        self.input_ids = torch.zeros(m, dtype=torch.int64, device=device)
        self.positions = torch.zeros(m, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((m,), NULL_SLOT, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(self.seq_rows, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(self.seq_rows, max_blocks_per_seq, dtype=torch.int32, device=device)
        # Decodes: row i's one token is token i, and tile i is row i's, always.
        self.decode_starts = torch.arange(self.seq_rows + 1, dtype=torch.int32, device=device)
        self.decode_tile_starts = torch.zeros(self.seq_rows, dtype=torch.int32, device=device)
        # Mixed steps: rewritten every step; tiles at most one per token.
        self.query_starts = torch.zeros(self.seq_rows + 1, dtype=torch.int32, device=device)
        self.tile_seq = torch.full((m,), self.seq_rows - 1, dtype=torch.int32, device=device)
        self.tile_start = torch.zeros(m, dtype=torch.int32, device=device)
        self.runs: dict[tuple[str, int], Callable[[], torch.Tensor]] = {}
        pool = None
        for size in reversed(self.token_sizes):  # the buffers start as padding: see _pad_mixed
            self.runs["mixed", size], pool = self._capture(forward, size, self._mixed_meta(size), pool)
        self.seq_lens.fill_(1)  # decode padding: one token in the null block
        for size in reversed(self.sizes):
            self.runs["decode", size], pool = self._capture(forward, size, self._decode_meta(size), pool)

    # The metadata a graph is captured with. Its host-side fields (max_*_len, *_cpu) are
    # placeholders: neither the model nor Triton attention reads them in a forward, and a
    # graph could not follow them if they did.

    def _decode_meta(self, size: int) -> AttentionMetadata:
        meta = AttentionMetadata(
            num_tokens=size,
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.decode_starts[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            max_query_len=1,
            max_seq_len=1,
            block_size=self.block_size,
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[1] * size,
        )
        meta.extra[self.attention] = (self.decode_starts[:size], self.decode_tile_starts[:size])
        return meta

    def _mixed_meta(self, size: int) -> AttentionMetadata:
        """Every request row, `size` tokens and tiles."""
        rows = self.seq_rows
        meta = AttentionMetadata(
            num_tokens=size,
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_starts,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            max_query_len=size,
            max_seq_len=size,
            block_size=self.block_size,
            query_lens_cpu=[0] * rows,
            seq_lens_cpu=[0] * rows,
        )
        meta.extra[self.attention] = (self.tile_seq[:size], self.tile_start[:size])
        return meta

    def _pad_mixed(self, num_tokens: int, num_seqs: int, num_tiles: int, size: int) -> None:
        """Makes tokens, request rows and tiles past a mixed step's own inert (see the module doc)."""
        self.slot_mapping[num_tokens:size].fill_(NULL_SLOT)
        self.query_starts[num_seqs + 1 :].fill_(num_tokens)  # no query tokens
        self.seq_lens[num_seqs:].zero_()  # no context
        self.tile_seq[num_tiles:size].fill_(self.seq_rows - 1)  # the last row: padding in every step
        self.tile_start[num_tiles:size].zero_()

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
        """The step's hidden states [T, hidden] from a graph, or None where no graph fits (more
        requests, tokens or wider block tables than captured). The result is a view of the
        graph's output buffer: valid until the next replay."""
        b, t = meta.num_seqs, meta.num_tokens
        width = meta.block_tables.shape[1]
        if b >= self.seq_rows or width > self.block_tables.shape[1]:
            return None
        decode = meta.max_query_len == 1 and t == b
        sizes = self.sizes if decode else self.token_sizes
        if t > sizes[-1]:
            return None
        size = next(s for s in sizes if s >= t)
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        self.seq_lens[:b].copy_(meta.seq_lens)
        self.block_tables[:b, :width].copy_(meta.block_tables)
        if decode:
            if size > b:
                # Rows a previous, larger step left behind become padding again.
                self.slot_mapping[b:size].fill_(NULL_SLOT)
                self.seq_lens[b:size].fill_(1)
                self.block_tables[b:size, 0].zero_()
            return self.runs["decode", size]()[:b]
        tile_seq, tile_start = meta.extra[self.attention]
        n = tile_seq.numel()
        assert n <= t, f"{n} attention tiles for {t} tokens"  # each tile holds at least one query token
        self.query_starts[: b + 1].copy_(meta.query_start_loc)
        self.tile_seq[:n].copy_(tile_seq)
        self.tile_start[:n].copy_(tile_start)
        self._pad_mixed(t, b, n, size)
        return self.runs["mixed", size]()[:t]
