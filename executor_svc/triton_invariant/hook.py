"""The post-load hook of --deterministic on CUDA: the model's linear layers,
LM head, RMSNorms and residual adds through the batch-invariant Triton
kernels of this package (model_loader.py calls `apply`).

The rest of a forward is already per row or per element on CUDA: the
embedding lookup, rope, SiLU·mul and dtype casts are elementwise (the same
math function for every element whatever the launch), and attention is the
Triton backend's, whose per-row arithmetic does not depend on the batch
(attention/triton_backend.py). Tensor parallelism is refused by the worker:
NCCL picks its all-reduce algorithm by message size, i.e. by token count.
"""

from __future__ import annotations

import torch

from executor_svc.layer_ops import Kernels
from executor_svc.model import LlamaForCausalLM
from executor_svc.triton_invariant import matmul, rms_norm
from executor_svc.triton_invariant.launch import interpreted

KERNELS = Kernels(linear=matmul.linear, add_rms_norm=rms_norm.add_rms_norm)


def apply(model: LlamaForCausalLM) -> None:
    """Installs KERNELS into a loaded CUDA model (or a CPU one under the interpreter, for tests)."""
    device = model.embed_tokens.device
    assert device.type == "cuda" or interpreted(), f"the Triton kernels need CUDA tensors, not {device}"
    assert model.compute_dtype in (torch.float32, torch.bfloat16), f"no invariant kernels for {model.compute_dtype}"
    model.use_kernels(KERNELS)
