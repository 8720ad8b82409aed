"""Ground truth for the attention backends: dense attention and synthetic paged batches.

Used by tests and benches only. `dense_attention` is written straight from the
definition, with no paging and no tricks, in float64 by default, so that a
backend's output can be compared with something that shares none of its code.

`make_batch` builds a step the way the model runner would see it: every
request's K/V for positions 0..seq_len-1 is drawn as a dense tensor, the
already-cached prefix is stored in the paged cache under a shuffled block
table, and the new tokens' K/V are handed over separately for `write_kv`.
Every cache slot no request owns (block 0, the tails of last blocks, spare
blocks) is filled with `poison` so that reading one shows up in the output.

`attend_in_steps` computes one request's tokens in steps of given sizes
(decodes, prefill chunks) beside other requests' decodes: --deterministic
asks for the same bits whatever the steps (tests, bench/gpu_check.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from executor_svc import kv_quant
from executor_svc.attention.metadata import AttentionMetadata


def dense_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Causal GQA attention for one request whose new tokens are its last ones.

    query [Q, H, D]; key, value [L, KV, D] with L >= Q. Query j sits at
    position L - Q + j and sees keys 0..L - Q + j. Returns [Q, H, D] in
    compute_dtype.
    """
    q_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    if seq_len < q_len or num_heads % num_kv_heads:
        raise ValueError(f"bad shapes: query {tuple(query.shape)}, key {tuple(key.shape)}")
    group = num_heads // num_kv_heads
    q = query.to(compute_dtype)
    k = key.to(compute_dtype).repeat_interleave(group, dim=1)  # head h uses kv head h // group
    v = value.to(compute_dtype).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    query_pos = torch.arange(seq_len - q_len, seq_len)
    visible = torch.arange(seq_len)[None, :] <= query_pos[:, None]  # [Q, L]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


@dataclass
class SyntheticBatch:
    meta: AttentionMetadata
    query: torch.Tensor  # [T, H, D]
    new_key: torch.Tensor  # [T, KV, D], what write_kv must store
    new_value: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, KV, D]: cached prefixes + poison
    v_cache: torch.Tensor
    keys: list[torch.Tensor]  # per request [seq_len, KV, D], the whole sequence
    values: list[torch.Tensor]
    scale: float

    def expected(self, compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The reference output [T, H, D] for the whole batch."""
        loc = self.meta.query_start_loc.tolist()
        outs = [
            dense_attention(self.query[loc[i] : loc[i + 1]], k, v, self.scale, compute_dtype)
            for i, (k, v) in enumerate(zip(self.keys, self.values))
        ]
        return torch.cat(outs)


def make_batch(
    shapes: list[tuple[int, int]],
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 3,
    spare_table_columns: int = 2,
    poison: float = float("nan"),
) -> SyntheticBatch:
    """One step over requests given as (num_cached_tokens, num_new_tokens).

    Block ids are a random permutation of 1..num_blocks-1, so tables are not
    contiguous; `spare_blocks` unowned blocks and `spare_table_columns` extra
    zero (null block) columns in the block table make stray reads visible.
    """
    if any(cached < 0 or new < 1 for cached, new in shapes):
        raise ValueError(f"every request needs >= 0 cached and >= 1 new tokens: {shapes}")
    gen = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    seq_lens = [cached + new for cached, new in shapes]
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks  # block 0 is the null block
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width = max(blocks_per_seq) + spare_table_columns
    block_tables = torch.zeros(len(shapes), width, dtype=torch.int32)

    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, poison, dtype=dtype)
    v_cache = torch.full(cache_shape, poison, dtype=dtype)
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)

    def randn(*size):
        return torch.randn(*size, generator=gen, dtype=torch.float64).to(dtype)

    keys, values, queries, slots, new_keys, new_values = [], [], [], [], [], []
    for i, ((cached, new), seq_len) in enumerate(zip(shapes, seq_lens)):
        table = [ids.pop() for _ in range(blocks_per_seq[i])]
        block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        pos = torch.arange(seq_len)
        seq_slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        k, v = randn(seq_len, num_kv_heads, head_dim), randn(seq_len, num_kv_heads, head_dim)
        k_flat[seq_slots[:cached]] = k[:cached]
        v_flat[seq_slots[:cached]] = v[:cached]
        keys.append(k)
        values.append(v)
        queries.append(randn(new, num_heads, head_dim))
        slots.append(seq_slots[cached:])
        new_keys.append(k[cached:])
        new_values.append(v[cached:])

    query_lens = [new for _, new in shapes]
    meta = AttentionMetadata(
        num_tokens=sum(query_lens),
        slot_mapping=torch.cat(slots).to(torch.int64),
        query_start_loc=torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    return SyntheticBatch(
        meta=meta,
        query=torch.cat(queries),
        new_key=torch.cat(new_keys),
        new_value=torch.cat(new_values),
        k_cache=k_cache,
        v_cache=v_cache,
        keys=keys,
        values=values,
        scale=head_dim**-0.5,
    )


def quantized(batch: SyntheticBatch) -> SyntheticBatch:
    """`batch` over an int8 cache (--kv-cache-dtype int8, kv_quant.py): the
    cached rows quantized (poisoned rows keep a NaN scale), and the reference
    K/V the values the cache holds, so that `expected` is exact attention
    over what a backend reads. The new tokens' K/V stay as given: write_kv
    quantizes them."""

    def stored(x: torch.Tensor, keys: bool) -> torch.Tensor:
        return kv_quant.dequantize_rows(kv_quant.quantize_rows(x, keys), torch.float64, keys)

    return dataclasses.replace(
        batch,
        k_cache=kv_quant.quantize_rows(batch.k_cache, keys=True),
        v_cache=kv_quant.quantize_rows(batch.v_cache),
        keys=[stored(k, True) for k in batch.keys],
        values=[stored(v, False) for v in batch.values],
    )


def attend_in_steps(
    backend,
    chunks: list[int],
    dtype: torch.dtype,
    seq_len: int,
    head_dim: int = 64,
    others: int = 0,
    block_size: int = 16,
    device: str = "cpu",
) -> torch.Tensor:
    """Every token of one request computed in steps of the given sizes (1 = a decode), each
    step beside `others` (<= 3) decodes of other requests; returns its tokens' outputs
    [seq_len, heads, head_dim]. The data are the same whatever `others`: the batch always
    holds the 3 others."""
    assert 0 <= others <= 3, others
    base = make_batch(
        [(0, seq_len)] + [(37 + 11 * i, 1) for i in range(3)],
        block_size=block_size,
        num_kv_heads=2,
        group=3,
        head_dim=head_dim,
        dtype=dtype,
        seed=3,
    )
    ctx = base.meta.seq_lens_cpu[1 : 1 + others]
    k_cache, v_cache = base.k_cache.to(device), base.v_cache.to(device)
    query, new_key, new_value = base.query.to(device), base.new_key.to(device), base.new_value.to(device)
    outs, start = [], 0
    for n in chunks:
        n = min(n, seq_len - start)
        rows = list(range(start, start + n)) + list(range(seq_len, seq_len + others))
        meta = dataclasses.replace(
            base.meta,
            num_tokens=len(rows),
            slot_mapping=base.meta.slot_mapping[rows].to(device),
            query_start_loc=torch.tensor([0, n] + [n + i + 1 for i in range(others)], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([start + n] + ctx, dtype=torch.int32, device=device),
            block_tables=base.meta.block_tables.to(device),
            max_query_len=n,
            max_seq_len=max([start + n] + ctx),
            query_lens_cpu=[n] + [1] * others,
            seq_lens_cpu=[start + n] + ctx,
            extra={},
        )
        backend.prepare(meta)
        backend.write_kv(new_key[rows], new_value[rows], k_cache, v_cache, meta)
        outs.append(backend.forward(query[rows], k_cache, v_cache, meta, base.scale)[:n])
        start += n
        if start == seq_len:
            return torch.cat(outs)
    raise AssertionError("chunks do not cover the request")
