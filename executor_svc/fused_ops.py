"""RMSNorm (with the residual add), rotary embedding, the SwiGLU gate and
the sampler's row argmax, exponential race and seeded noise, each in one
native pass, for CPU tensors: float32 (native/fused_ops.c) and, all but the
sampler's, bfloat16 (native/fused_ops_bf16.c, which rounds to bfloat16 where
torch's bf16 ops round: see its header), plus the write of new K/V rows into
a bfloat16 cache.

`available(*tensors)` says whether an op's tensors can take the native path;
the model falls back to plain torch otherwise (CUDA, mixed dtypes, no C
compiler, bfloat16 without AVX-512).
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache

import torch

from executor_svc import kv_quant
from executor_svc.native_build import load_library

SOURCE = os.path.join(os.path.dirname(__file__), "native", "fused_ops.c")
BF16_SOURCE = os.path.join(os.path.dirname(__file__), "native", "fused_ops_bf16.c")


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    """The library, its functions typed from native_signatures.py; None without a compiler."""
    return load_library(SOURCE)


@lru_cache(maxsize=1)
def _bf16_lib() -> ctypes.CDLL | None:
    """The bfloat16 kernels; None without a compiler or where the build has no
    AVX-512 path (they return -1 then: a call over zero rows asks)."""
    lib = load_library(BF16_SOURCE)
    return lib if lib is not None and lib.silu_mul_bf16(None, 0, None, 0, 0, 0, 1) == 0 else None


# Each dtype's library; every lookup goes through this table (tests and
# bench.fused_ops_ab switch the bf16 kernels off by replacing an entry).
_LIBRARIES = {torch.float32: _lib, torch.bfloat16: _bf16_lib}


def available(*tensors: torch.Tensor) -> bool:
    """Whether an op over `tensors` (its inputs: all on CPU, of one dtype) has a native kernel here."""
    dtype = tensors[0].dtype
    return (
        dtype in _LIBRARIES
        and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)
        and _LIBRARIES[dtype]() is not None
    )


def _ran(status: int | None) -> None:
    """A void float32 kernel gives None; a bfloat16 one 0, or -1 without its vector path."""
    assert status in (None, 0), "a bfloat16 kernel without its AVX-512 path was called (available() says no)"


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as 2-D rows with unit stride along the last dimension (copied only if not)."""
    assert x.dim() == 2, f"expected a [rows, width] tensor, got shape {tuple(x.shape)}"
    return x if x.stride(1) == 1 else x.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[rows, dim] -> x / sqrt(mean(x^2) + eps) * weight, a new tensor."""
    return _rms_norm(_rows(x), None, weight, eps)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h += delta in place (the residual add), then returns rms_norm(h): one pass.
    h must be contiguous (it is updated where it lies)."""
    assert h.is_contiguous() and h.dim() == 2 and delta.shape == h.shape and available(h, delta), (
        f"add_rms_norm: h {tuple(h.shape)} {h.stride()}, delta {tuple(delta.shape)} {delta.dtype} {delta.device}"
    )
    return _rms_norm(h, _rows(delta), weight, eps)


def add_rms_norm_bf16_out(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor | None:
    """add_rms_norm (rms_norm where delta is None) over float32 rows, its output
    rounded to bfloat16 in the same pass: add_rms_norm(...).to(torch.bfloat16)
    bit for bit (a NaN's pattern aside), for a GEMM that reads bf16 rows.
    None where the build has no AVX-512 path."""
    assert h.dtype == torch.float32 and h.is_contiguous() and h.dim() == 2, f"h {tuple(h.shape)} {h.dtype}"
    assert delta is None or (delta.shape == h.shape and delta.dtype == torch.float32), "delta must match h"
    return _rms_norm(h, None if delta is None else _rows(delta), weight, eps, bf16_out=True)


def _rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, bf16_out: bool = False
) -> torch.Tensor | None:
    """The norm kernel of x's dtype; with bf16_out, float32 x's that rounds
    as it writes (None where that has no AVX-512 path)."""
    assert weight.is_contiguous() and weight.shape == (x.shape[1],) and weight.dtype == x.dtype, (
        f"weight {tuple(weight.shape)} {weight.dtype} for {tuple(x.shape)} {x.dtype}"
    )
    assert not bf16_out or x.dtype == torch.float32, "bf16_out rounds a float32 norm"
    out = torch.empty(x.shape, dtype=torch.bfloat16 if bf16_out else x.dtype)
    lib = _LIBRARIES[x.dtype]()
    if bf16_out:
        kernel = lib.rms_norm_f32_bf16_out
    else:
        kernel = lib.rms_norm_bf16 if x.dtype == torch.bfloat16 else lib.rms_norm_f32
    status = kernel(
        out.data_ptr(),
        out.stride(0),
        x.data_ptr(),
        x.stride(0),
        None if delta is None else delta.data_ptr(),
        0 if delta is None else delta.stride(0),
        weight.data_ptr(),
        x.shape[0],
        x.shape[1],
        eps,
        torch.get_num_threads(),
    )
    if bf16_out and status == -1:
        return None
    _ran(status)
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotates x [tokens, heads, dim] in place (x may be a view into a fused
    qkv row: only its last dimension must be contiguous); cos and
    sin_signed are [tokens, dim]. Returns x."""
    tokens, heads, dim = x.shape
    assert x.stride(2) == 1 and dim % 2 == 0, f"rope needs unit-stride, even head dims: {x.stride()}, {dim}"
    assert (
        cos.shape == sin_signed.shape == (tokens, dim) and cos.stride() == sin_signed.stride() and cos.stride(1) == 1
    ), f"cos/sin {tuple(cos.shape)} {cos.stride()} for x {tuple(x.shape)}"
    assert cos.dtype == sin_signed.dtype == x.dtype, f"cos/sin {cos.dtype} for x {x.dtype}"
    lib = _LIBRARIES[x.dtype]()
    status = (lib.rope_bf16 if x.dtype == torch.bfloat16 else lib.rope_f32)(
        x.data_ptr(),
        x.stride(0),
        x.stride(1),
        cos.data_ptr(),
        sin_signed.data_ptr(),
        cos.stride(0),
        tokens,
        heads,
        dim,
        torch.get_num_threads(),
    )
    _ran(status)
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """[rows, 2 * inter] ([gate | up]) -> silu(gate) * up, a new tensor; None
    where the native build has no vector path (no AVX-512)."""
    lib = _LIBRARIES[gate_up.dtype]()
    return _gate(gate_up, lib.silu_mul_bf16 if gate_up.dtype == torch.bfloat16 else lib.silu_mul_f32)


def silu_mul_bf16_io(gate_up: torch.Tensor) -> torch.Tensor | None:
    """bfloat16 [rows, 2 * inter] ([gate | up]) -> silu(gate) * up in float32
    arithmetic, rounded to bfloat16 once: silu_mul(gate_up.float()) rounded as
    .to(torch.bfloat16) rounds, bit for bit, without the float32 copies. None
    where the native build has no vector path (no AVX-512)."""
    assert gate_up.dtype == torch.bfloat16 and gate_up.device.type == "cpu", f"{gate_up.dtype} on {gate_up.device}"
    lib = _bf16_lib()
    return None if lib is None else _gate(gate_up, lib.silu_mul_f32_bf16_io)


def _gate(gate_up: torch.Tensor, kernel) -> torch.Tensor | None:
    """`kernel` (a silu_mul_* entry point) over gate_up's rows into a new tensor of its dtype; None if it has no vector path."""
    gate_up = _rows(gate_up)
    assert gate_up.shape[1] % 2 == 0, f"gate_up width {gate_up.shape[1]} is odd"
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    status = kernel(
        out.data_ptr(), out.stride(0), gate_up.data_ptr(), gate_up.stride(0), rows, inter, torch.get_num_threads()
    )
    return out if status == 0 else None


def writes_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether `write_kv` runs natively for these: a bfloat16 or int8 cache on
    CPU, keys and values of a dtype with native kernels, unit-stride heads."""
    return (
        k_cache.dtype in (torch.bfloat16, torch.int8)
        and v_cache.dtype == k_cache.dtype
        and k_cache.device.type == v_cache.device.type == "cpu"
        and _LIBRARIES[torch.bfloat16]() is not None
        and available(key, value)
        and key.stride(2) == value.stride(2) == 1
    )


def write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """k_cache/v_cache [blocks, block_size, kv_heads, dim] bfloat16, or int8
    [.., kv_heads, dim + 4] (kv_quant.py): token t's key/value [tokens,
    kv_heads, dim] (bfloat16 or float32; rounded as .to(torch.bfloat16)
    rounds, or quantized as kv_quant.quantize_rows does; views with
    unit-stride heads, as the heads of a fused qkv row) into slot slots[t]
    (int64), as TorchAttentionBackend.write_kv does. IndexError for a slot
    outside the cache, before anything is written."""
    tokens, heads, dim = key.shape
    int8 = k_cache.dtype == torch.int8
    assert value.shape == key.shape and key.stride(2) == value.stride(2) == 1, (
        f"key {tuple(key.shape)} {key.stride()}, value {tuple(value.shape)} {value.stride()}"
    )
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape, "KV caches"
    assert k_cache.shape[2:] == (heads, kv_quant.row_bytes(dim) if int8 else dim)
    assert writes_kv(key, value, k_cache, v_cache), f"KV {key.dtype} {key.device} into {k_cache.dtype} {k_cache.device}"
    assert slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape == (tokens,), f"slots {slots.shape}"
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    lib = _LIBRARIES[torch.bfloat16]()
    status = (lib.kv_write_int8 if int8 else lib.kv_write_bf16)(
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        num_slots,
        key.data_ptr(),
        key.stride(0),
        key.stride(1),
        value.data_ptr(),
        value.stride(0),
        value.stride(1),
        int(key.dtype == torch.float32),
        slots.data_ptr(),
        tokens,
        heads,
        dim,
    )
    if status == -2:
        raise IndexError(f"a KV slot outside the cache's {num_slots}: {slots.tolist()}")
    _ran(status)


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """[rows, cols] float32 -> int64 [rows], each row's first largest index, or its
    first NaN's (as torch.argmax); None where the native build has no vector
    path (no AVX-512)."""
    assert x.dtype == torch.float32, f"argmax_rows reads float32 logits, got {x.dtype}"
    x = _rows(x)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    status = _lib().argmax_rows_f32(
        out.data_ptr(), x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], torch.get_num_threads()
    )
    return out if status == 0 else None


def race_rows(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
    """[rows, cols] float32 -> int64 [rows]: argmax_v x[r, v] - log E_v, E_v = -log u_v,
    where u_v is seeded_noise.seeded_uniform's uniform for row key keys[r] (int64
    [rows] in [0, 2**32)) and token v (native/fused_ops.c: race_rows_f32). Ties
    and NaN as argmax_rows; None where the native build has no vector path."""
    assert x.dtype == torch.float32 and keys.dtype == torch.int64, f"race_rows reads float32, int64; got {x.dtype}"
    assert keys.shape == (x.shape[0],) and keys.is_contiguous(), f"one key per row, got {tuple(keys.shape)}"
    x = _rows(x)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    status = _lib().race_rows_f32(
        out.data_ptr(), x.data_ptr(), x.stride(0), keys.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads()
    )
    return out if status == 0 else None


def seeded_uniform_rows(keys: torch.Tensor, vocab_keys: torch.Tensor) -> torch.Tensor | None:
    """float32 [S, V] (vocab_keys [V]) or [S, W] (vocab_keys [S, W]): seeded_noise.seeded_uniform's
    uniforms for row keys `keys` [S] (its row_keys), bit for bit, in one native pass
    (native/fused_ops.c: seeded_uniform_rows_f32); None off CPU or where the build has no vector path."""
    assert keys.dtype == vocab_keys.dtype == torch.int64 and keys.dim() == 1, f"{keys.dtype} {vocab_keys.dtype}"
    lib = _lib()
    if lib is None or keys.device.type != "cpu" or vocab_keys.device.type != "cpu":
        return None
    keys, vk = keys.contiguous(), vocab_keys.contiguous()
    per_row = vk.dim() == 2
    assert not per_row or vk.shape[0] == keys.shape[0], f"{tuple(vk.shape)} keys for {keys.shape[0]} rows"
    out = torch.empty(keys.shape[0], vk.shape[-1], dtype=torch.float32)
    status = lib.seeded_uniform_rows_f32(
        out.data_ptr(),
        out.stride(0),
        keys.data_ptr(),
        vk.data_ptr(),
        vk.stride(0) if per_row else 0,
        keys.shape[0],
        vk.shape[-1],
        torch.get_num_threads(),
    )
    return out if status == 0 else None


def logsumexp_rows(x: torch.Tensor) -> torch.Tensor | None:
    """[rows, cols] float32 -> float32 [rows, 1], each row's logsumexp (torch's
    to within a few float32 roundings; NaN, +-inf and all -inf rows as torch
    has them; native/fused_ops.c: logsumexp_rows_f32); None where the native
    build has no vector path (no AVX-512)."""
    assert x.dtype == torch.float32 and x.dim() == 2, f"logsumexp_rows reads float32 [rows, cols], got {x.dtype}"
    lib = _lib()
    if lib is None or x.device.type != "cpu":
        return None
    x = _rows(x)
    out = torch.empty(x.shape[0], 1, dtype=torch.float32)
    status = lib.logsumexp_rows_f32(
        out.data_ptr(), x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], torch.get_num_threads()
    )
    return out if status == 0 else None


def topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """[rows, cols] float32 -> (values [rows, k], int64 indices [rows, k]): each
    row's k largest in descending order, torch.topk's values exactly, equal
    values in index order, -0 returned as +0 (native/fused_ops.c:
    topk_rows_f32); None where the native build has no vector path, or a row
    holds a NaN or +inf (torch's topk orders those)."""
    assert x.dtype == torch.float32 and x.dim() == 2, f"topk_rows reads float32 [rows, cols], got {x.dtype}"
    assert 1 <= k <= x.shape[1], f"k = {k} of {x.shape[1]} columns"
    lib = _lib()
    if lib is None or x.device.type != "cpu":
        return None
    x = _rows(x)
    values = torch.empty(x.shape[0], k, dtype=torch.float32)
    ids = torch.empty(x.shape[0], k, dtype=torch.int64)
    status = lib.topk_rows_f32(
        values.data_ptr(),
        k,
        ids.data_ptr(),
        k,
        x.data_ptr(),
        x.stride(0),
        x.shape[0],
        x.shape[1],
        k,
        torch.get_num_threads(),
    )
    assert status in (0, -1, -2), f"topk_rows_f32 returned {status}"
    return (values, ids) if status == 0 else None


def temper_rows(x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor | None:
    """[rows, cols] float32 / temperature [rows], clamped to float32's largest
    finite value, as a new tensor: `(x / temperature[:, None]).clamp_(max=...)`
    bit for bit in one pass (native/fused_ops.c: temper_rows_f32); None where
    the native build has no vector path."""
    assert x.dtype == temperature.dtype == torch.float32 and x.dim() == 2, f"{x.dtype} {temperature.dtype}"
    assert temperature.shape == (x.shape[0],), f"one temperature per row, got {tuple(temperature.shape)}"
    lib = _lib()
    if lib is None or x.device.type != "cpu":
        return None
    x, t = _rows(x), temperature.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32)
    status = lib.temper_rows_f32(
        out.data_ptr(),
        out.stride(0),
        x.data_ptr(),
        x.stride(0),
        t.data_ptr(),
        x.shape[0],
        x.shape[1],
        torch.get_num_threads(),
    )
    return out if status == 0 else None
