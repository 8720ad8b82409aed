"""The CPU backend: native kernels that read K/V in place from the paged cache.

Decode attention is memory bound: each decode reads its whole K/V history to
produce one token. `native/paged_decode.c` reads those rows in place from the
paged cache; the plain-torch backend must gather them into a copy first,
which moves three times the bytes.

Prefills (many query tokens per K/V row) are compute bound.
`native/paged_prefill.c` runs them in FMA form straight from the cache,
16 query tokens per work item; for shapes or CPUs it has no path for (it
says so by returning -1) they go to `TorchAttentionBackend` (SDPA).

How a step's query tokens become the kernels' work items (decode items,
16-token prefill items, every token a decode item under --deterministic):
cpu_step_layout.py.
"""

from __future__ import annotations

import torch

from executor_svc import fused_ops, kv_quant
from executor_svc.attention import native_kernel
from executor_svc.attention.cpu_step_layout import PrefillItems, plan_step
from executor_svc.attention.metadata import AttentionMetadata
from executor_svc.attention.native_kernel import PrefillKernel
from executor_svc.attention.torch_backend import TorchAttentionBackend, check_metadata

_MAX_HEADS = 256  # the kernel's per-item stack arrays (MAX_HEADS in paged_decode.c)
# How prefills of a bfloat16 cache run: the native kernel widening K/V to
# float32, SDPA in bfloat16, or the kernel multiplying raw bf16 pairs with
# VDPBF16PS (emulated where the CPU lacks it); routes.py times them on CPUs
# with native bf16.
PREFILL_ROUTES = ("native", "sdpa", "dot")
# paged_prefill.c's `cache_bf16` bits (PREFILL_INT8: an int8 cache, kv_quant.py).
_PREFILL_BF16, _PREFILL_DOT, _PREFILL_DOT_EMULATED, _PREFILL_INT8 = 1, 2, 4, 8
# How the decode kernel multiplies over a bfloat16 cache: K/V widened to
# float32 for float32 FMAs, or raw bf16 pairs through VDPBF16PS with the
# queries and probabilities rounded to bf16 (its emulation where the CPU
# lacks the instruction); routes.py times them on CPUs with it.
DECODE_ROUTES = ("widen", "dot")
# paged_decode.c's `bf16` bits: which operands are bfloat16 (else float32),
# the dot arithmetic (native or emulated), and an int8 cache (kv_quant.py).
_BF16_KV, _BF16_Q, _BF16_OUT, _BF16_DOT, _BF16_DOT_EMULATED, _KV_INT8 = 1, 2, 4, 8, 16, 32


def _kernel_operand(t: torch.Tensor) -> bool:
    """Whether the decode kernel reads or writes `t` [tokens, heads, head_dim] in place."""
    return t.dtype in (torch.float32, torch.bfloat16) and t.stride(2) == 1


class CpuAttentionBackend:
    name = "cpu"

    def __init__(
        self,
        kernel,
        prefill_kernel: PrefillKernel | None = None,
        batch_invariant: bool = False,
        prefill_route: str = "native",
        decode_route: str = "widen",
        dot_native: bool | None = None,
    ):
        self._kernel = kernel
        self._prefill_kernel = prefill_kernel
        self.batch_invariant = batch_invariant
        self._prefills = TorchAttentionBackend(handle_decodes=False)
        self._widen_kernel = kernel
        # Whether the dot route runs VDPBF16PS (else its emulation); None = what
        # this CPU has (native_kernel.dot_native). Tests force the emulation.
        self._dot_native = dot_native
        self.use_prefill_route(prefill_route)
        self.use_decode_route(decode_route)

    def use_prefill_route(self, route: str) -> None:
        """Prefills over a bfloat16 cache through `route` from the next step on:
        "native" (the kernel, float32 arithmetic), "sdpa" (SDPA with the
        queries rounded to bfloat16) or "dot" (the kernel's bf16 dot product,
        queries and probabilities rounded to bfloat16). A float32 cache always
        takes the kernel's float32 arithmetic; batch-invariant mode, the
        decode kernel."""
        if route not in PREFILL_ROUTES:
            raise ValueError(f"prefill route {route!r}: expected one of {PREFILL_ROUTES}")
        if route != "native" and self.batch_invariant:
            raise ValueError("batch-invariant attention runs every prefill token through the decode kernel")
        self.prefill_route = route
        self._prefill_bf16_flags = _PREFILL_BF16
        if route == "dot":
            native = self._dot_native
            if native is None:  # what the prefill kernel's own build runs here
                native = self._prefill_kernel is not None and self._prefill_kernel.dot_native
            self._prefill_bf16_flags |= _PREFILL_DOT if native else _PREFILL_DOT_EMULATED

    def use_decode_route(self, route: str) -> None:
        """Decodes over a bfloat16 cache through `route` from the next step on:
        "widen" (float32 FMAs, the kernel this backend was built with) or
        "dot" (VDPBF16PS, emulated where this CPU lacks it, from the kernel's
        dot build, which also serves float32 caches and the widening
        arithmetic). Batch-invariant mode keeps "widen", the arithmetic
        docs/determinism.md describes."""
        if route not in DECODE_ROUTES:
            raise ValueError(f"decode route {route!r}: expected one of {DECODE_ROUTES}")
        if route == "dot" and self.batch_invariant:
            raise ValueError("batch-invariant attention keeps the widening decode kernel")
        self._kernel = self._widen_kernel
        self.decode_bf16_flags = _BF16_KV  # the kernel's bits for a bfloat16 cache (the decoder stack's too)
        if route == "dot":
            kernel = native_kernel.load(dot=True)
            if kernel is None:
                raise ValueError("decode route 'dot': the decode kernel's dot build is unavailable here")
            native = native_kernel.dot_native() if self._dot_native is None else self._dot_native
            self._kernel = kernel
            self.decode_bf16_flags |= _BF16_DOT if native else _BF16_DOT_EMULATED
        self.decode_route = route

    def decode_flags(self, cache_dtype: torch.dtype) -> int:
        """The decode kernel's bits for a cache of `cache_dtype` (the queries' and
        output's aside): the decode route's over bfloat16, int8's, none for float32."""
        return {torch.bfloat16: self.decode_bf16_flags, torch.int8: _KV_INT8}.get(cache_dtype, 0)

    def write_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        """K/V (bfloat16, or float32 from a widened model or float32 weights)
        into a bfloat16 or int8 cache: one native pass for both, rounding
        float32 as torch's .to() does (or quantizing as kv_quant.py does),
        instead of up to four operator calls a layer; a float32 cache through
        torch's index_copy_."""
        if fused_ops.writes_kv(key, value, k_cache, v_cache):
            fused_ops.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        else:
            self._prefills.write_kv(key, value, k_cache, v_cache, meta)

    def prepare(self, meta: AttentionMetadata) -> None:
        check_metadata(meta)
        meta.extra.pop(self._prefills.name, None)  # the SDPA plan is built only if a layer needs it
        per_item = None if self._prefill_kernel is None else self._prefill_kernel.tokens_per_item
        meta.extra[self.name] = plan_step(meta, self.batch_invariant, per_item)

    def forward(
        self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        plan = meta.extra.get(self.name)
        if plan is None:
            raise RuntimeError("CpuAttentionBackend.forward before prepare(meta) for this step")
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads = k_cache.shape[2]
        assert num_heads % num_kv_heads == 0 and num_heads <= _MAX_HEADS, (
            f"{num_heads} query heads over {num_kv_heads} KV heads is not supported by the native kernels"
        )
        assert kv_quant.head_dim_of(k_cache) == head_dim, f"KV cache rows {k_cache.shape[3]} for queries of {head_dim}"
        assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV caches must be contiguous"
        assert k_cache.dtype in (torch.float32, torch.bfloat16, torch.int8) and v_cache.dtype == k_cache.dtype, (
            f"KV cache dtypes {k_cache.dtype}, {v_cache.dtype}"
        )
        if out is None:
            out = query.new_empty(query.shape)
        tables = meta.block_tables if meta.block_tables.dtype == torch.int32 else meta.block_tables.to(torch.int32)
        bf16, int8 = int(k_cache.dtype == torch.bfloat16), k_cache.dtype == torch.int8

        if plan.has_prefills and bf16 and self.prefill_route == "sdpa":
            # By route: SDPA in bfloat16, the gathered K/V as stored and the
            # queries rounded to them, so that its GEMMs run in bf16.
            out = self._sdpa_prefills(query.to(torch.bfloat16), k_cache, v_cache, meta, scale, out)
        elif plan.has_prefills:
            # The prefill kernel reads float32 queries with unit-stride heads
            # (a view into a fused qkv row qualifies) and writes float32: into
            # `out` directly when it is float32 with unit-stride heads, else
            # into a buffer cast after.
            q = query.to(torch.float32)
            if q.stride(2) != 1:
                q = q.contiguous()
            direct = out.dtype == torch.float32 and out.stride(2) == 1
            target = out if direct else torch.empty(q.shape, dtype=torch.float32)
            flags = self._prefill_bf16_flags if bf16 else _PREFILL_INT8 if int8 else 0
            prefill_rows = self._native_prefills(plan.prefills, q, k_cache, v_cache, tables, flags, meta, scale, target)
            if prefill_rows is None:  # no native path for this shape or CPU: SDPA
                out = self._sdpa_prefills(query, k_cache, v_cache, meta, scale, out)
            elif not direct:
                out.index_copy_(0, prefill_rows, target.index_select(0, prefill_rows).to(out.dtype))

        d = plan.decodes
        if d is None:
            return out
        if d.block_tables is not None:
            tables, seq_lens = d.block_tables, d.seq_lens
        else:
            seq_lens = meta.seq_lens if meta.seq_lens.dtype == torch.int32 else meta.seq_lens.to(torch.int32)
        # The decode kernel reads float32 or bfloat16 queries and writes either
        # dtype in place (unit-stride heads), so a bfloat16 model's queries and
        # outputs need no float32 copies; anything else goes through float32.
        dq = query if _kernel_operand(query) else query.to(torch.float32).contiguous()
        dout = out if _kernel_operand(out) else torch.empty(query.shape, dtype=torch.float32)
        flags = self.decode_flags(k_cache.dtype) | _BF16_Q * (dq.dtype == torch.bfloat16)
        flags |= _BF16_OUT * (dout.dtype == torch.bfloat16)
        status = self._kernel(
            dout.data_ptr(),
            dout.stride(0),
            dout.stride(1),
            dq.data_ptr(),
            dq.stride(0),
            dq.stride(1),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            flags,
            tables.data_ptr(),
            tables.stride(0),
            seq_lens.data_ptr(),
            d.tokens.data_ptr(),
            d.tokens.data_ptr(),
            d.seq_index.data_ptr(),
            d.tokens.numel(),
            num_heads,
            num_kv_heads,
            head_dim,
            meta.block_size,
            d.max_seq_len,
            scale,
            torch.get_num_threads(),
        )
        if status == -2:
            raise RuntimeError(
                f"decode route {self.decode_route!r}: the kernel has no bf16 dot path for {num_heads} query heads"
                f" over {num_kv_heads} KV heads of {head_dim} (native_kernel.dot_supported)"
            )
        if status != 0:
            raise MemoryError("native decode attention could not allocate its scratch buffers")
        if dout is not out:
            out.index_copy_(0, d.tokens, dout.index_select(0, d.tokens).to(out.dtype))
        return out

    def _sdpa_prefills(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float, out) -> torch.Tensor:
        """Every prefill token's attention into `out` through the torch backend (SDPA)."""
        if self._prefills.name not in meta.extra:
            self._prefills.prepare(meta)  # once per step, shared by the layers
        return self._prefills.forward(query, k_cache, v_cache, meta, scale, out)

    def _native_prefills(
        self,
        items: PrefillItems | None,
        q,
        k_cache,
        v_cache,
        tables,
        flags: int,
        meta: AttentionMetadata,
        scale: float,
        target,
    ) -> torch.Tensor | None:
        """Every prefill token's attention into `target` through the native
        kernel; returns the prefill query rows, or None (nothing written)
        where there is no kernel or it has no path for this shape or CPU."""
        if items is None:
            if flags & (_PREFILL_DOT | _PREFILL_DOT_EMULATED):
                raise RuntimeError("prefill route 'dot' needs the native prefill kernel, which is not built here")
            return None
        status = self._prefill_kernel.attend(
            target.data_ptr(),
            target.stride(0),
            target.stride(1),
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            flags,
            tables.data_ptr(),
            tables.stride(0),
            items.token.data_ptr(),
            items.count.data_ptr(),
            items.pos.data_ptr(),
            items.seq_index.data_ptr(),
            items.token.numel(),
            q.shape[1],
            k_cache.shape[2],
            q.shape[2],
            meta.block_size,
            scale,
            torch.get_num_threads(),
        )
        if status == -1 and not flags & (_PREFILL_DOT | _PREFILL_DOT_EMULATED):
            return None
        if status in (-1, -4):
            raise RuntimeError(
                f"prefill route {self.prefill_route!r}: the prefill kernel has no bf16 dot path for"
                f" {q.shape[1]} query heads over {k_cache.shape[2]} KV heads of {q.shape[2]}"
            )
        if status == -2:
            raise MemoryError("native prefill attention could not allocate its scratch buffers")
        assert status == 0, f"native prefill attention rejected its work items (status {status})"
        return items.rows
