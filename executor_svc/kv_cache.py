"""Paged KV memory: sizing and one-time allocation.

Per layer, K and V are each [num_blocks, block_size, num_kv_heads, head_dim]
(int8 caches: head_dim + 4 bytes, the values and their scale, kv_quant.py):
a token's vectors are contiguous, so writing a step's new tokens is one
index_copy per layer, and a block's tokens are one contiguous slab for the
attention kernels. Block 0 is the reserved null block (padding in block tables).

With tensor parallelism each rank holds only its share of the KV heads
(num_kv_heads / tp_size) but the same number of blocks: block ids are global,
so one block table addresses the same block on every rank.
"""

from __future__ import annotations

import torch

from executor_svc import kv_quant
from executor_svc.model_config import ModelConfig

GIB = 1 << 30


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """K and V of one block across all layers, on one of tp_size ranks."""
    return 2 * cfg.num_hidden_layers * block_size * (cfg.num_key_value_heads // tp_size) * _row_bytes(cfg, dtype)


def _row_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one token's K (or V) for one KV head."""
    if dtype == torch.int8:
        return kv_quant.row_bytes(cfg.head_dim)
    return cfg.head_dim * torch.empty((), dtype=dtype).element_size()


def num_blocks_for_budget(
    budget_bytes: int, cfg: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1
) -> int:
    """Blocks that fit in one rank's `budget_bytes`."""
    n = budget_bytes // bytes_per_block(cfg, block_size, dtype, tp_size)
    if n < 2:
        raise ValueError(
            f"a KV budget of {budget_bytes / GIB:.3f} GiB holds {n} block(s) of {block_size} tokens; "
            "at least 2 are needed (block 0 is reserved): raise --kv-cache-gib"
        )
    return int(n)


def allocate_kv_caches(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device, tp_size: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    last = kv_quant.row_bytes(cfg.head_dim) if dtype == torch.int8 else cfg.head_dim
    shape = (num_blocks, block_size, cfg.num_key_value_heads // tp_size, last)
    # zeros, not empty: the null block must hold finite values, since padded
    # lanes of a kernel may read it before masking.
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(cfg.num_hidden_layers)
    ]
