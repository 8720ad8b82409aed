"""The attention-backend interface the model and the runner depend on.

Three backends implement it: "cpu" (cpu_backend.py, native kernels reading
K/V in place), "torch" (torch_backend.py, gather + SDPA, any device) and
"triton" (triton_backend.py, CUDA, or Triton's interpreter in tests).
`executor_svc.attention.get_backend` picks one by name.

A step runs `prepare` once, then every layer calls `write_kv` and `forward`
with the same metadata; whatever `prepare` computes for the layers lives in
`meta.extra[name]`, so a backend object keeps no per-step state of its own.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from executor_svc.attention.metadata import AttentionMetadata


@runtime_checkable
class AttentionBackend(Protocol):
    name: str  # also its key in meta.extra

    def prepare(self, meta: AttentionMetadata) -> None:
        """Called once per step before the layers run; may precompute and stash
        backend-specific index tensors in meta.extra[self.name] (shared by all layers)."""

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """key/value [num_tokens, num_kv_heads, head_dim]; writes token i into
        slot meta.slot_mapping[i] (= block_id * block_size + offset)."""

    def forward(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """query [num_tokens, num_heads, head_dim] -> the same shape: causal
        attention of each request's new tokens over its cached tokens plus its
        new tokens (already written by write_kv), with GQA. (A backend may take
        more, optional, arguments: the torch one an `out` buffer.)"""
