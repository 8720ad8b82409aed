"""Paged attention: one interface (backend.py's `AttentionBackend`), three
backends: "cpu" (native kernels), "torch" (gather + SDPA) and "triton" (CUDA).

KV cache layout, per layer, allocated once at start:

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

Block 0 is the reserved null block: padding entries of block tables point to
it, and nothing a request reads is ever stored there.
"""

from executor_svc.attention.backend import AttentionBackend
from executor_svc.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend"]


def get_backend(name: str, batch_invariant: bool = False) -> AttentionBackend:
    """Returns the backend called `name` ("cpu", "torch" or "triton").

    "cpu" needs a C compiler for its decode kernel; without one it falls back
    to "torch" (and says so in the log), except with `batch_invariant`
    (--deterministic), which needs the kernel and raises ValueError. The
    Triton kernel is batch-invariant as it stands (triton_backend.py); the
    torch backend's SDPA is not.
    """
    if name == "cpu":
        from executor_svc.attention import native_kernel

        kernel = native_kernel.load()
        if kernel is not None:
            from executor_svc.attention.cpu_backend import CpuAttentionBackend

            return CpuAttentionBackend(kernel, native_kernel.load_prefill(), batch_invariant)
        if batch_invariant:
            raise ValueError("--deterministic needs the native CPU attention kernel, which could not be built here")
        name = "torch"
    if name == "torch":
        if batch_invariant:
            raise ValueError("--deterministic: the torch attention backend (SDPA) is not batch-invariant")
        from executor_svc.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from executor_svc.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; expected 'cpu', 'torch' or 'triton'")
