"""Paged attention in plain PyTorch: the CPU backend.

A CPU has no way to read the paged cache in place from PyTorch, so every
layer gathers each request's K/V rows into a contiguous buffer and hands it to
`scaled_dot_product_attention`. The gather is the cost that matters (decode
attention is memory bound), so everything here serves to move as few bytes
as possible, and to touch no fresh memory:

- Decodes (1 query token) are sorted by length and cut into groups whose
  lengths are within `pad_tolerance` of the group's longest, so padding stays
  small; a group is also capped at `max_group_tokens` rows so its buffer
  (8192 rows of K+V: 12 MiB in float32 for SmolLM2) stays in the last-level
  cache between the gather and the attention that reads it. Both defaults
  are what bench/attention_cpu.py measured fastest. A group is one
  SDPA call in which a request's `group` query heads that share a KV head
  stand in as that KV head's "query length", so GQA needs no K/V copy:

      query [n, H, D] --view--> [n, KV, G, D]     K, V [n, KV, L, D]

- Prefills and chunked prefills (>1 query token) run one SDPA each, with
  enable_gqa and a causal mask shifted by the request's cached length (or,
  with nothing cached, SDPA's is_causal, which skips the masked half).
- K/V are gathered into a workspace the backend keeps across layers and
  steps: a fresh buffer per call costs more in page faults than the copy.

Row arithmetic for one decode group (L = longest length in the group):

    group row r, position p  ->  slot block_tables[r][p // bs] * bs + p % bs
    p >= seq_len(r)          ->  the request's position-0 slot, masked out

Padding rows point at a real row of the same request instead of the null
block or the tail of its last block: those may hold anything (NaN
included), and SDPA would propagate a NaN score even where masked.

The gather plans are built once per step in prepare() and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from executor_svc import kv_quant
from executor_svc.attention.metadata import AttentionMetadata


@dataclass
class _DecodeGroup:
    tokens: torch.Tensor  # [n] int64, query token index of each request
    slots: torch.Tensor  # [n * L] int64, row-major (request, position)
    mask: torch.Tensor | None  # [n, 1, 1, L] bool, None when all have length L
    length: int  # L


@dataclass
class _Prefill:
    start: int  # first query token
    end: int
    slots: torch.Tensor  # [seq_len] int64
    # [query_len, seq_len] bool, causal shifted by the cached length; None for
    # a prefill with nothing cached, where SDPA's own is_causal skips the
    # masked-out half of the work instead of computing and discarding it.
    mask: torch.Tensor | None


@dataclass
class _TorchStepLayout:
    decode_groups: list[_DecodeGroup]
    prefills: list[_Prefill]
    max_rows: int  # largest gather of the step, sizes the workspace


class TorchAttentionBackend:
    """Not re-entrant: one workspace is shared by all layers and calls."""

    name = "torch"

    def __init__(self, pad_tolerance: float = 0.15, max_group_tokens: int = 8192, handle_decodes: bool = True):
        if not 0.0 <= pad_tolerance <= 1.0 or max_group_tokens < 1:
            raise ValueError(f"bad tuning: pad_tolerance={pad_tolerance}, max_group_tokens={max_group_tokens}")
        self.pad_tolerance = pad_tolerance
        self.max_group_tokens = max_group_tokens
        # False: leave decodes (1 query token) to a caller that has a faster path.
        self.handle_decodes = handle_decodes
        self._workspace: torch.Tensor | None = None  # [2, rows, KV * D]

    def prepare(self, meta: AttentionMetadata) -> None:
        query_lens, seq_lens, bs = meta.query_lens_cpu, meta.seq_lens_cpu, meta.block_size
        check_metadata(meta)
        starts = meta.query_start_loc.tolist()
        tables = meta.block_tables.to(torch.int64)
        device = tables.device
        decodes = sorted((i for i, q in enumerate(query_lens) if q == 1), key=lambda i: -seq_lens[i])
        if not self.handle_decodes:
            decodes = []

        groups: list[_DecodeGroup] = []
        members: list[int] = []
        for i in decodes + [None]:  # None flushes the last group
            if members and (
                i is None
                or seq_lens[i] < seq_lens[members[0]] * (1.0 - self.pad_tolerance)
                or (len(members) + 1) * seq_lens[members[0]] > self.max_group_tokens
            ):
                groups.append(_decode_group(members, starts, seq_lens, tables, bs))
                members = []
            if i is not None:
                members.append(i)

        prefills = []
        for i, q_len in enumerate(query_lens):
            if q_len == 1:
                continue
            seq_len = seq_lens[i]
            pos = torch.arange(seq_len, device=device)
            slots = tables[i, pos // bs] * bs + pos % bs
            query_pos = torch.arange(seq_len - q_len, seq_len, device=device)
            mask = None if q_len == seq_len else pos[None, :] <= query_pos[:, None]
            prefills.append(_Prefill(starts[i], starts[i + 1], slots, mask))

        max_rows = max([g.slots.numel() for g in groups] + [p.slots.numel() for p in prefills] + [0])
        meta.extra[self.name] = _TorchStepLayout(groups, prefills, max_rows)

    def write_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        num_kv_heads, row = k_cache.shape[2], k_cache.shape[3]
        for new, cache, keys in ((key, k_cache, True), (value, v_cache, False)):
            # .to() is a no-op unless the cache is stored narrower than the model (--kv-cache-dtype).
            stored = kv_quant.quantize_rows(new, keys) if kv_quant.is_quantized(cache) else new.to(cache.dtype)
            cache.view(-1, num_kv_heads, row).index_copy_(0, meta.slot_mapping, stored)

    def forward(
        self,
        query,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        plan = meta.extra.get(self.name)
        if plan is None:
            raise RuntimeError("TorchAttentionBackend.forward before prepare(meta) for this step")
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads, row = k_cache.shape[2], k_cache.shape[3]
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not divide into {num_kv_heads} KV heads")
        group = num_heads // num_kv_heads
        if out is None:
            out = query.new_empty(num_tokens, num_heads, head_dim)
        k_rows = k_cache.view(-1, num_kv_heads * row)
        v_rows = v_cache.view(-1, num_kv_heads * row)
        k_ws, v_ws = self._workspace_for(plan.max_rows, k_rows)

        for g in plan.decode_groups:
            n, length, rows = g.tokens.numel(), g.length, g.slots.numel()
            k = torch.index_select(k_rows, 0, g.slots, out=k_ws[:rows])
            v = torch.index_select(v_rows, 0, g.slots, out=v_ws[:rows])
            k = _values(k.view(n, length, num_kv_heads, row), query.dtype, keys=True).transpose(1, 2)
            v = _values(v.view(n, length, num_kv_heads, row), query.dtype).transpose(1, 2)
            q = query.index_select(0, g.tokens).view(n, num_kv_heads, group, head_dim)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scale)
            out.index_copy_(0, g.tokens, o.reshape(n, num_heads, head_dim))

        for p in plan.prefills:
            rows = p.slots.numel()
            k = torch.index_select(k_rows, 0, p.slots, out=k_ws[:rows])
            v = torch.index_select(v_rows, 0, p.slots, out=v_ws[:rows])
            k = _values(k.view(1, rows, num_kv_heads, row), query.dtype, keys=True).transpose(1, 2)
            v = _values(v.view(1, rows, num_kv_heads, row), query.dtype).transpose(1, 2)
            q = query[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=True
            )
            out[p.start : p.end] = o[0].transpose(0, 1)
        return out

    def _workspace_for(self, rows: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ws = self._workspace
        if (
            ws is None
            or ws.shape[1] < rows
            or ws.shape[2] != like.shape[1]
            or ws.dtype != like.dtype
            or ws.device != like.device
        ):
            # Grow by 25% beyond the need so a slowly growing batch does not reallocate every step.
            ws = like.new_empty(2, max(rows, rows * 5 // 4), like.shape[1])
            self._workspace = ws
        return ws[0], ws[1]


def _values(gathered: torch.Tensor, dtype: torch.dtype, keys: bool = False) -> torch.Tensor:
    """Gathered cache rows as `dtype` values: a cast, or int8 rows dequantized (kv_quant.py)."""
    if kv_quant.is_quantized(gathered):
        return kv_quant.dequantize_rows(gathered, dtype, keys)
    return gathered.to(dtype)


def _decode_group(members, starts, seq_lens, tables, block_size) -> _DecodeGroup:
    device = tables.device
    idx = torch.tensor(members, dtype=torch.int64, device=device)
    lengths = torch.tensor([seq_lens[i] for i in members], device=device)
    length = seq_lens[members[0]]  # members are sorted longest first
    pos = torch.arange(length, device=device)
    slots = tables[idx][:, pos // block_size] * block_size + pos % block_size  # [n, L]
    valid = pos[None, :] < lengths[:, None]
    slots = torch.where(valid, slots, slots[:, :1])
    tokens = torch.tensor([starts[i] for i in members], dtype=torch.int64, device=device)
    mask = None if bool(valid.all()) else valid[:, None, None, :]
    return _DecodeGroup(tokens, slots.reshape(-1), mask, length)


def check_metadata(meta: AttentionMetadata) -> None:
    query_lens, seq_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    if len(query_lens) != len(seq_lens) or sum(query_lens) != meta.num_tokens:
        raise ValueError(
            f"metadata disagrees: {len(query_lens)} query lens summing to {sum(query_lens)}, "
            f"{len(seq_lens)} seq lens, num_tokens={meta.num_tokens}"
        )
    if not query_lens:
        raise ValueError("attention metadata has no requests")
    for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
        if q < 1 or s < q:
            raise ValueError(f"request {i}: query_len={q}, seq_len={s}; need 1 <= query_len <= seq_len")
    needed = -(-max(seq_lens) // meta.block_size)
    if meta.block_tables.shape[1] < needed:
        raise ValueError(f"block_tables has {meta.block_tables.shape[1]} columns, a request needs {needed}")
