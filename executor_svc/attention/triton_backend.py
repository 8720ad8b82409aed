"""Paged attention as Triton kernels: the GPU backend.

Two kernels:

- `_reshape_and_cache_kernel`, one program per new token: copies the token's
  K and V ([num_kv_heads, head_dim] each) into its slot of the paged cache.
- `_paged_attention_kernel`, one program per (query tile, KV head): reads the
  request's K/V block by block through its block table, in place, with an
  online softmax. Decodes and (chunked) prefills share it: a decode is a
  request whose only query tile has one token.

A query tile is BLOCK_Q consecutive query tokens of one request times the
GROUP query heads that share the program's KV head, so each K/V row loaded
serves BLOCK_Q * GROUP query rows. Tile rows are laid out query-major:

    row r  ->  query token q_tile_start + r // GROUP_PAD,  head kv_head * GROUP + r % GROUP_PAD
    (GROUP_PAD = next power of two >= GROUP; rows with r % GROUP_PAD >= GROUP are idle)

Query token j of a request sits at position ctx + j (ctx = seq_len - query_len)
and sees keys 0..ctx + j, so a tile never loads keys past its last token's
position: slots past seq_len (a last block's tail, the null block) are never
read, whatever they hold.

With TRITON_INTERPRET=1 set before triton is first imported, the same kernels
run in Triton's interpreter on CPU tensors; that is how the tests run them.
The interpreter keeps bfloat16 as raw 16-bit integers, which its tl.dot
would multiply as integers, so there (`WIDEN`) bfloat16 q, k and v are
widened to float32 as loaded: the same sums in the same order, in the
interpreter's float32 arithmetic rather than a GPU's bf16 MMA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from executor_svc.attention.metadata import AttentionMetadata
from executor_svc.attention.torch_backend import check_metadata

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_h,
    block_size,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    dst_base = (slot // block_size) * cache_stride_block + (slot % block_size) * cache_stride_slot
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < HEAD_DIM)
    k = tl.load(key_ptr + t * key_stride_t + h * key_stride_h + d, mask=mask)
    v = tl.load(value_ptr + t * value_stride_t + h * value_stride_h + d, mask=mask)
    tl.store(k_cache_ptr + dst_base + h * cache_stride_h + d, k, mask=mask)
    tl.store(v_cache_ptr + dst_base + h * cache_stride_h + d, v, mask=mask)


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    tile_seq_ptr,
    tile_start_ptr,
    scale,
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_h,
    block_tables_stride,
    block_size,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    tile_start = tl.load(tile_start_ptr + tile)  # first query index of the tile, within the request
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - query_len

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    q_idx = tile_start + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_valid = (q_idx < query_len) & (rows % GROUP_PAD < GROUP)
    q_pos = ctx + q_idx
    token = (q_start + q_idx).to(tl.int64)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = d < HEAD_DIM
    q = tl.load(
        q_ptr + token[:, None] * q_stride_t + head[:, None] * q_stride_h + d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if WIDEN:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    # Keys beyond the tile's last query position are invisible to all its rows.
    kv_end = ctx + tl.minimum(tile_start + BLOCK_Q, query_len)
    table_row = block_tables_ptr + seq.to(tl.int64) * block_tables_stride
    for n_start in range(0, kv_end, BLOCK_N):
        n = n_start + tl.arange(0, BLOCK_N)
        n_valid = n < kv_end
        block = tl.load(table_row + n // block_size, mask=n_valid, other=0).to(tl.int64)
        kv_offset = block * cache_stride_block + (n % block_size) * cache_stride_slot + kv_head * cache_stride_h
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(k_cache_ptr + kv_offset[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offset[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if WIDEN:
            k, v = k.to(tl.float32), v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        visible = n_valid[None, :] & (n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Idle rows see no key at all; keep their arithmetic finite (they are never stored).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + token[:, None] * out_stride_t + head[:, None] * out_stride_h + d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_valid[None, :],
    )


class TritonAttentionBackend:
    """block_q: query tokens per tile; block_n: keys per inner-loop step.

    On a GPU tl.dot needs every tile side >= 16 (block_q * GROUP_PAD, block_n,
    head_dim); the interpreter takes any power of two, which keeps tests fast.
    """

    name = "triton"

    def __init__(self, block_q: int = 16, block_n: int = 32):
        for label, v in (("block_q", block_q), ("block_n", block_n)):
            if v < 1 or v & (v - 1):
                raise ValueError(f"{label} must be a power of two, got {v}")
        self.block_q = block_q
        self.block_n = block_n
        # Decode steps' tiles, (arange, zeros) on the device, sliced per step.
        self._decode_tiles: tuple[torch.Tensor, torch.Tensor] | None = None

    def prepare(self, meta: AttentionMetadata) -> None:
        check_metadata(meta)
        device = meta.seq_lens.device
        if meta.max_query_len == 1:
            # Decodes only: tile i is request i's one token. Slices of tensors kept
            # on the device, not two host-to-device copies a step.
            n = meta.num_seqs
            tiles = self._decode_tiles
            if tiles is None or tiles[0].numel() < n or tiles[0].device != device:
                size = max(n, 256)
                tiles = self._decode_tiles = (
                    torch.arange(size, dtype=torch.int32, device=device),
                    torch.zeros(size, dtype=torch.int32, device=device),
                )
            meta.extra[self.name] = (tiles[0][:n], tiles[1][:n])
            return
        tile_seq, tile_start = [], []
        for i, q_len in enumerate(meta.query_lens_cpu):
            for start in range(0, q_len, self.block_q):
                tile_seq.append(i)
                tile_start.append(start)
        meta.extra[self.name] = (
            torch.tensor(tile_seq, dtype=torch.int32, device=device),
            torch.tensor(tile_start, dtype=torch.int32, device=device),
        )

    def write_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        num_tokens, num_kv_heads, head_dim = key.shape
        _check_cache(k_cache, v_cache, key)
        if key.stride(2) != 1 or value.stride(2) != 1 or value.shape != key.shape:
            raise ValueError(f"key/value must match and have unit stride in head_dim: {key.shape}, {value.shape}")
        if meta.slot_mapping.numel() != num_tokens:
            raise ValueError(f"{num_tokens} tokens but {meta.slot_mapping.numel()} slots")
        if num_tokens == 0:
            return
        _reshape_and_cache_kernel[(num_tokens,)](
            key,
            value,
            k_cache,
            v_cache,
            meta.slot_mapping,
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            meta.block_size,
            num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(num_kv_heads),
            BLOCK_D=triton.next_power_of_2(head_dim),
        )

    def forward(
        self,
        query,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        tiles = meta.extra.get(self.name)
        if tiles is None:
            raise RuntimeError("TritonAttentionBackend.forward before prepare(meta) for this step")
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[2]
        _check_cache(k_cache, v_cache, query)
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not divide into {num_kv_heads} KV heads")
        if query.stride(2) != 1:
            raise ValueError("query must have unit stride in head_dim")
        if out is None:
            out = torch.empty_like(query)
        group = num_heads // num_kv_heads
        group_pad = triton.next_power_of_2(group)
        head_dim_pad = triton.next_power_of_2(head_dim)
        if query.device.type != "cpu" and min(self.block_q * group_pad, self.block_n, head_dim_pad) < 16:
            raise ValueError(
                f"on a GPU tl.dot needs tiles >= 16: block_q={self.block_q} x group {group_pad}, "
                f"block_n={self.block_n}, head_dim {head_dim_pad}"
            )
        tile_seq, tile_start = tiles
        _paged_attention_kernel[(tile_seq.numel(), num_kv_heads)](
            out,
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            tile_seq,
            tile_start,
            scale,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            meta.block_tables.stride(0),
            meta.block_size,
            GROUP=group,
            GROUP_PAD=group_pad,
            BLOCK_Q=self.block_q,
            BLOCK_N=self.block_n,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
            WIDEN=query.dtype == torch.bfloat16 and isinstance(_paged_attention_kernel, InterpretedFunction),
        )
        return out


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, like: torch.Tensor) -> None:
    if like.device.type == "cpu" and not isinstance(_paged_attention_kernel, InterpretedFunction):
        raise RuntimeError(
            "Triton kernels got CPU tensors: they need CUDA tensors, or TRITON_INTERPRET=1 "
            "set before triton is first imported"
        )
    if k_cache.dtype not in _DTYPES or like.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"dtypes must agree and be one of {_DTYPES}: {like.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError(
            f"k/v caches must share shape and strides with unit head_dim stride: "
            f"{k_cache.shape} {k_cache.stride()}, {v_cache.shape} {v_cache.stride()}"
        )
    if k_cache.device != like.device:
        raise ValueError(f"cache on {k_cache.device}, tensors on {like.device}")
