"""The int8 KV cache (--kv-cache-dtype int8): layout, and the reference
quantization in torch.

Decode attention reads every cached K/V byte of every request at every step,
so at large batches it is bound by memory bandwidth (docs/benchmarks.md);
bfloat16 K/V are 2 bytes a value. Stored as int8 with one float32 scale per
token and KV head, they are 1 + 4 / head_dim bytes a value: a block holds
1.88x the tokens of a bf16 one at head_dim 64, and a decode step reads that
much less. The kernels read the rows in place (attention/native/decode_int8.h,
paged_prefill.c).

Layout: the cache tensors are int8 [num_blocks, block_size, num_kv_heads,
head_dim + SCALE_BYTES]; each (token, KV head) row is head_dim int8 values q
and then the float32 scale s (native byte order), value = q * s, with

    s = max|x| / 127,    q = round_half_even(x * (127 / max|x|))

over the row's float32 values x (a row of zeros: s = 0, q = 0; a row with a
NaN: s = NaN, q = 0 there). The error of a stored value is at most 1/254 of
its row's largest magnitude: for values, of the row itself; for rotated keys,
of the rotated row (an L2 error of at most sqrt(head_dim) / 254 of its
largest rotated value). Keys whose head_dim is a power of two are stored
rotated, x = fwht(k) (native/hadamard.h says why: a few outlier channels
would otherwise set every row's scale), and the kernels rotate each query
to meet them: q.k = fwht(q).fwht(k). Values are stored as they are. native/fused_ops_bf16.c's
kv_write_int8 computes the same formula op for op, and
tests/test_kv_int8.py checks the two write the same bytes.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one float32 per (token, KV head) row


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def row_bytes(head_dim: int) -> int:
    """Bytes of one (token, KV head) row of an int8 cache."""
    return head_dim + SCALE_BYTES


def head_dim_of(cache: torch.Tensor) -> int:
    """The head_dim of a cache tensor [blocks, block_size, kv_heads, last] of any storage dtype."""
    return cache.shape[-1] - SCALE_BYTES if is_quantized(cache) else cache.shape[-1]


def rotates(head_dim: int) -> bool:
    """Whether keys of this head_dim are stored rotated (fwht): a power of two."""
    return head_dim > 0 and head_dim & (head_dim - 1) == 0


def fwht(x: torch.Tensor) -> torch.Tensor:
    """The normalized Walsh-Hadamard transform over the last dim (a power of
    two), float32: native/hadamard.h's butterflies in its order, then its
    scale, so that both give the same bits. Its own inverse."""
    n = x.shape[-1]
    assert rotates(n), f"fwht over {n} values"
    x = x.to(torch.float32)
    h = 1
    while h < n:
        pairs = x.reshape(*x.shape[:-1], n // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*x.shape[:-1], n)
        h *= 2
    return x * (torch.ones((), dtype=torch.float32) / torch.tensor(float(n)).sqrt())


def quantize_rows(x: torch.Tensor, keys: bool = False) -> torch.Tensor:
    """x [..., head_dim] (any float dtype) -> int8 [..., head_dim + SCALE_BYTES]
    rows; `keys` are rotated first where `rotates(head_dim)`."""
    x = fwht(x) if keys and rotates(x.shape[-1]) else x.to(torch.float32)
    amax = x.abs().amax(dim=-1, keepdim=True)
    levels = amax.new_full((), 127.0)
    # Divisions of tensors, as C divides: torch computes `127.0 / amax` as 127 x (1 / amax).
    scale = amax / levels
    inv = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
    # A row so small that 127 / max|x| overflows: its values clamp to +-127, as in C.
    q = torch.nan_to_num(torch.round(x * inv), nan=0.0, posinf=127.0, neginf=-127.0).clamp_(-127, 127)
    return torch.cat([q.to(torch.int8), scale.contiguous().view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32, keys: bool = False) -> torch.Tensor:
    """int8 rows [..., head_dim + SCALE_BYTES] -> values [..., head_dim] in
    `dtype` (computed in float32, or float64 when asked for: a reference's);
    `keys` rotated back where they were stored rotated."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32).to(wide)
    values = rows[..., :-SCALE_BYTES].to(wide) * scale
    if keys and rotates(values.shape[-1]):
        # fwht is its own inverse; a float64 reference's, exactly.
        values = fwht(values) if wide == torch.float32 else values @ _hadamard64(values.shape[-1])
    return values.to(dtype)


def _hadamard64(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5
