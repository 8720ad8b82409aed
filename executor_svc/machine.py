"""What this machine and the executor's options make of each path, decided
once at start-up by the Worker: the device, the dtype `auto` resolves to,
whether the native GEMM takes the linear layers, whether a bfloat16 model
times its bf16 GEMM routes, whether GGUF blocks take int8 activations, and
what --deterministic needs on CUDA. Each answer is logged where it is used.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable

import torch

from executor_svc import onednn_linear, packed_linear
from executor_svc.native_build import cpu_flags


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return torch.device(name)


def cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX: without them bf16 matmuls run ~3x slower than float32."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cache_bytes(
    cpus: Iterable[int] | None = None, root: str = "/sys/devices/system/cpu", levels: tuple[str, ...] = ("2", "3")
) -> int | None:
    """The bytes of the cache `levels` (default L2 and L3) the given CPUs
    (default: those this process may run on) reach, each cache instance
    counted once however many CPUs share it; None where Linux does not say
    (no sysfs). All of L2 and L3 is what a weight must outgrow to come from
    memory at every step: one L3 of a many-chiplet EPYC is a fraction of the
    CPU's, and non-inclusive L2s hold data an L3 no longer does."""
    if cpus is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    seen, total = set(), 0
    for cpu in cpus:
        for index in glob.glob(f"{root}/cpu{cpu}/cache/index*"):
            level, size = _read(f"{index}/level"), _read(f"{index}/size") or ""
            if level not in levels:
                continue
            key = (level, _read(f"{index}/shared_cpu_list") or f"cpu{cpu}")
            if key in seen:
                continue
            seen.add(key)
            if size[:-1].isdigit() and size[-1] in _SIZE_UNITS:
                total += int(size[:-1]) * _SIZE_UNITS[size[-1]]
            elif size.isdigit():
                total += int(size)
    return total or None


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        fast_bf16 = device.type == "cuda" or cpu_has_fast_bf16()
        return torch.bfloat16 if fast_bf16 else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def use_packed_gemm(name: str, device: torch.device, dtype: torch.dtype, deterministic: bool = False) -> bool:
    """Whether --cpu-gemm resolves to the native packed kernel (packed_linear.py):
    for float32 weights, and for bfloat16 ones (float32 arithmetic over them,
    weight_packing.widen_bf16; see measure_bf16_routes for CPUs with bf16 of their own).
    --deterministic needs it for either dtype on every CPU: its sums are the
    batch-invariant ones (docs/determinism.md); on CUDA the Triton kernels
    take its place (check_deterministic_cuda)."""
    if name == "torch" or device.type != "cpu":
        return False
    # resolve_dtype gives float32 or bfloat16 only: the kernel takes either.
    built = packed_linear.kernel() is not None
    if deterministic and not built:
        raise ValueError("--deterministic needs the native GEMM (an x86 CPU with AVX-512 and a C compiler)")
    if name == "native" and not built:
        raise ValueError("--cpu-gemm native needs an x86 CPU with AVX-512 plus a C compiler; the kernel is unavailable")
    return built


def measure_bf16_routes(name: str, packed_gemm: bool, dtype: torch.dtype, deterministic: bool = False) -> bool:
    """Whether a widened bfloat16 model measures at start-up which GEMM takes
    each row count (bf16_gemm_routes.py): with --cpu-gemm auto on CPUs with
    native bf16 and a bf16 GEMM to offer there (the kernel's VDPBF16PS loop,
    oneDNN); elsewhere both emulate bf16 and never beat the float32 kernel.
    Never under --deterministic: their sums depend on the row count, and
    weight_packing refuses them there too."""
    return (
        name == "auto"
        and packed_gemm
        and dtype == torch.bfloat16
        and not deterministic
        and cpu_has_fast_bf16()
        and (packed_linear.kernel().bf16_dot_native or onednn_linear.available())
    )


def measure_native_rows(name: str, packed_gemm: bool, deterministic: bool = False) -> bool:
    """Whether the model measures at start-up how many rows the native kernel's
    float32 arithmetic takes before MKL does (float_gemm_rows.py): with
    --cpu-gemm auto and the kernel; never under --deterministic, where the
    kernel takes every row count."""
    return name == "auto" and packed_gemm and not deterministic


def gguf_int8_rows(activations: str, packed_gemm: bool, gguf_blocks: str, deterministic: bool = False) -> int:
    """Up to how many rows GGUF Q4_1/Q8_0 blocks take int8 activations
    (packed_linear.INT8_MAX_ROWS, or 0 = never): with --gguf-activations int8,
    the native GEMM and its blocks, on CPUs with AVX512-VNNI (the kernel has
    no emulation), never under --deterministic (its rounding depends on the
    route, hence on the row count; the config refuses the pair too)."""
    return (
        packed_linear.INT8_MAX_ROWS
        if activations == "int8"
        and packed_gemm
        and gguf_blocks == "auto"
        and not deterministic
        and packed_linear.kernel().int8_native
        else 0
    )


def check_deterministic_cuda(attention_backend: str, tp_size: int) -> None:
    """Raises ValueError where --deterministic on CUDA cannot keep its promise:
    its linears, head and norms are the Triton kernels of triton_invariant/
    and its attention must be the Triton backend (whose per-row arithmetic
    does not depend on the batch); NCCL's all-reduce picks its algorithm by
    message size, i.e. by the step's token count, so no tensor parallelism."""
    if attention_backend != "triton":
        raise ValueError(f"--deterministic on CUDA needs the triton attention backend, not {attention_backend!r}")
    if tp_size > 1:
        raise ValueError(
            "--deterministic on CUDA runs on one GPU: NCCL's all-reduce picks its algorithm by message size, "
            "so a token's sums across ranks would depend on the batch (docs/determinism.md)"
        )
