"""The decoder stack of a decode step in one native call (native/decoder_stack.c).

A decode step of a small model is mostly dispatch: the embedded SmolLM2's 30
layers cost ~300 kernel calls from Python a step, each 15-30 us of Python,
ctypes and allocation around a few microseconds of work. `DecoderStack`
hands the native driver the addresses of the same kernels the Python path
calls, the model's packed weights and the KV cache once, and per step the
step's tensors; the driver runs every layer and the final norm in
DecoderLayer.forward's order. The result is the Python path's bit for bit
(tests/test_decoder_stack.py), so nothing else changes: default and
--deterministic modes, routes, logging. One thing the Python path does not
do: on the bf16 dot route each layer's GEMMs prefetch the key blocks the
next layer's attention will read (`warm_bytes`; decoder_stack.c says why).
Where gate/up and down both take that route, SwiGLU runs on the gate/up
GEMM's tiles, as layer_ops.mlp runs it (gemm_epilogues.swiglu_dot's kernel).

Where it applies (`DecoderStack.build` says None otherwise, and
`DecoderStack.forward` returns None for a step it does not take):
- CPU, one rank, the native CPU attention backend, float32 activations
  (a float32 model, or a bfloat16 one widened to float32), a float32,
  bfloat16 or int8 KV cache, the native fused ops and packed GEMM built;
- a step whose every query token is a decode item of the attention kernel
  (no prefill chunk; in --deterministic mode every step qualifies);
- every linear routed, at the step's row count, to the packed kernel
  (panels, blocks, the BF16 or Q4_1 blocks' dot loops, int8 activations
  over GGUF blocks: packed_linear.route), not to MKL or oneDNN.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from typing import TYPE_CHECKING

import structlog
import torch

from executor_svc import fused_ops, kv_quant, machine
from executor_svc.layer_ops import Kernels
from executor_svc.model import KVCache, LlamaForCausalLM
from executor_svc.native_build import load_library
from executor_svc.packed_linear import BLOCK_FORMATS, kernel, route

if TYPE_CHECKING:
    from executor_svc.attention.metadata import AttentionMetadata

log = structlog.get_logger(__name__)

SOURCE = os.path.join(os.path.dirname(__file__), "native", "decoder_stack.c")
LINEARS = ("qkv", "o", "gate_up", "down")
_PANELS, _BLOCKS, _DOT, _INT8, _GGUF_DOT = 0, 1, 2, 3, 4  # ds_linear.route
_ROUTES = ("panels", "blocks", "gguf", "dot", "int8", "gguf_dot")  # packed_linear.route's answers the driver runs
# Steps of up to this many rows reuse one scratch buffer (decode batches);
# larger ones (--deterministic prefills) allocate theirs per step, as the
# Python path's activations are, so the buffer never holds a prefill's size.
_KEPT_SCRATCH_ROWS = 256
_VP, _I64, _F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


# Mirrors of decoder_stack.c's structs, field for field (checked on load).
class _Linear(ctypes.Structure):
    _fields_ = [("weights", _VP), ("bias", _VP), ("route", _I64), ("fmt", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _VP), ("post_norm", _VP), ("k_cache", _VP), ("v_cache", _VP)] + [
        (name, _Linear) for name in LINEARS
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        (name, _VP)
        for name in (
            "gemm_panels",
            "gemm_blocks",
            "gemm_bf16_dot",
            "gemm_int8",
            "gemm_gguf_dot",
            "swiglu_dot",
            "rms_norm",
            "rope",
            "silu_mul",
            "kv_write",
            "attention",
        )
    ]
    _fields_ += [("final_norm", _VP)]
    _fields_ += [
        (name, _I64)
        for name in (
            "num_layers",
            "hidden",
            "inter",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "block_size",
            "kv_narrow",
            "attention_flags",
            "bf16_dot_native",
            "num_slots",
            "block_bytes",
            "warm_bytes",
        )
    ]
    _fields_ += [("eps", _F64), ("scale", _F64)]


class _Step(ctypes.Structure):
    _fields_ = [
        (name, _VP)
        for name in ("h", "out", "scratch", "cos", "sin_signed", "slots", "block_tables", "seq_lens", "tokens")
    ]
    _fields_ += [("seq_index", _VP)]
    _fields_ += [(name, _I64) for name in ("num_tokens", "table_stride", "max_seq_len", "num_threads")]


# Each mirror by its C name.
MIRRORS = {"ds_linear": _Linear, "ds_layer": _Layer, "ds_model": _Model, "ds_step": _Step}


def layout_differences(lib: ctypes.CDLL, mirrors: dict[str, type[ctypes.Structure]]) -> list[str]:
    """Where `mirrors` differ from decoder_stack.c's structs (sizes, field
    offsets by name, the number of names); empty where they agree."""
    checks = []
    for c_name, mirror in mirrors.items():
        checks.append((c_name, ctypes.sizeof(mirror)))
        checks += [(f"{c_name}.{field}", getattr(mirror, field).offset) for field, _ in mirror._fields_]
    diffs = []
    for name, value in checks:
        c_value = lib.decoder_stack_layout(name.encode())
        if c_value != value:
            diffs.append(f"{name}: C {c_value}, ctypes {value}")
    if lib.decoder_stack_layout(None) != len(checks):
        diffs.append(f"C knows {lib.decoder_stack_layout(None)} names, the mirrors {len(checks)}")
    return diffs


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    lib = load_library(SOURCE)
    if lib is None:
        return None
    diffs = layout_differences(lib, MIRRORS)
    assert not diffs, f"decoder_stack.c's structs and their ctypes mirrors differ: {diffs}"
    return lib


def warm_bytes() -> int:
    """Key bytes the dot GEMMs of a layer warm for the next layer's attention
    (decoder_stack.c): half the L3 this process reaches, so that the warmed
    blocks and the weights streamed beside them both fit; 0 (no warming)
    where Linux does not say how large the L3 is."""
    return (machine.cache_bytes(levels=("3",)) or 0) // 2


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class DecoderStack:
    """The model's decoder layers as one native call, for one KV cache."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], lib: ctypes.CDLL):
        self._lib, self._model_ref, self._kv = lib, model, kv_caches
        self._backend = model.attn_backend
        cfg, first = model.config, model.layers[0]
        k_cache = kv_caches[0][0]
        gemm, f32 = kernel(), fused_ops._LIBRARIES[torch.float32]()
        bf16_lib = fused_ops._LIBRARIES[torch.bfloat16]
        writer = {torch.bfloat16: "kv_write_bf16", torch.int8: "kv_write_int8"}.get(k_cache.dtype)
        self._model = _Model(
            gemm_panels=_address(gemm.gemm),
            gemm_blocks=_address(gemm.gemm_blocks),
            gemm_bf16_dot=_address(gemm.gemm_bf16_dot_warm),
            gemm_int8=_address(gemm.gemm_int8),
            gemm_gguf_dot=_address(gemm.gemm_quant_bf16_dot),
            # Gate panel p pairs with up panel p + inter / width: whole panels only.
            swiglu_dot=_address(gemm.gemm_bf16_dot_swiglu)
            if first.down_weight.shape[1] % gemm.panel_width == 0
            else None,
            rms_norm=_address(f32.rms_norm_f32),
            rope=_address(f32.rope_f32),
            silu_mul=_address(f32.silu_mul_f32),
            kv_write=_address(getattr(bf16_lib(), writer)) if writer else None,
            attention=_address(self._backend._kernel),  # and again each step (forward)
            final_norm=model.norm.data_ptr(),
            num_layers=len(model.layers),
            hidden=cfg.hidden_size,
            inter=first.down_weight.shape[1],
            num_heads=first.num_heads,
            num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            block_size=k_cache.shape[1],
            kv_narrow=int(writer is not None),
            attention_flags=0,  # set per step, from the backend's decode route
            bf16_dot_native=int(gemm.bf16_dot_native),
            num_slots=k_cache.shape[0] * k_cache.shape[1],
            block_bytes=k_cache[0].numel() * k_cache.element_size(),
            # Not for an int8 cache: its decode kernel is bound by the
            # dequantisation, not the reads (64 decodes at context 256 on a
            # Zen 5: attention 0.25 ms faster a step, the GEMMs 0.5 ms slower).
            warm_bytes=warm_bytes() if k_cache.dtype != torch.int8 else 0,
            eps=cfg.rms_norm_eps,
            scale=first.scale,
        )
        log.info("decoder_stack_warming", key_bytes_per_layer=self._model.warm_bytes)
        # Layer tables by row count and by routes; None where a route is not
        # native. A table holds raw pointers into the packed weights: each
        # entry keeps the PackedWeights it was built from alive beside it.
        self._by_rows: dict[int, ctypes.Array | None] = {}
        self._by_routes: dict[tuple[str, ...], tuple[ctypes.Array, list] | None] = {}
        self._scratch = torch.empty(0, dtype=torch.float32)

    @staticmethod
    def build(model: LlamaForCausalLM, kv_caches: list[KVCache]) -> DecoderStack | None:
        """A stack for `model` over `kv_caches`, or None where the driver cannot run them (see the module doc)."""
        from executor_svc.attention.cpu_backend import _MAX_HEADS, CpuAttentionBackend

        if not isinstance(model, LlamaForCausalLM):  # a test's stand-in model
            return None
        k_cache = kv_caches[0][0] if kv_caches else None
        f32 = fused_ops._LIBRARIES[torch.float32]()
        first = model.layers[0] if len(model.layers) else None
        usable = (
            k_cache is not None
            and first is not None
            and k_cache.device.type == "cpu"
            # The checks CpuAttentionBackend.forward makes before its kernel call:
            # the kernel keeps per-head state in arrays of _MAX_HEADS.
            and first.num_heads % first.num_kv_heads == 0
            and first.num_heads <= _MAX_HEADS
            and k_cache.shape[2] == first.num_kv_heads
            and kv_quant.head_dim_of(k_cache) == first.head_dim
            and model.tp_size == 1
            and isinstance(model.attn_backend, CpuAttentionBackend)
            and model.compute_dtype == torch.float32
            and kernel() is not None
            and f32 is not None
            and f32.silu_mul_f32(None, 0, None, 0, 0, 0, 1) == 0  # 0 = its vector path is built
            and (
                k_cache.dtype == torch.float32
                or (
                    k_cache.dtype in (torch.bfloat16, torch.int8) and fused_ops._LIBRARIES[torch.bfloat16]() is not None
                )
            )
            and all(k.is_contiguous() and v.is_contiguous() for k, v in kv_caches)
        )
        lib = _lib() if usable and DecoderStack._kernels_unchanged(model) else None
        if lib is None:
            log.info("decoder_stack", path="python")
            return None
        steps = "every step" if model.attn_backend.batch_invariant else "decode-only steps"
        log.info("decoder_stack", path="native", applies_to=f"{steps} whose linears take packed routes")
        return DecoderStack(model, kv_caches, lib)

    @staticmethod
    def _kernels_unchanged(model: LlamaForCausalLM) -> bool:
        """Whether the model and every layer still run the default Kernels
        (tests and the CUDA --deterministic path swap them)."""
        default = Kernels()
        return model.kernels == default and all(layer.kernels == default for layer in model.layers)

    def _same_kernels(self) -> bool:
        """Whether the Python path would still call the kernels this stack calls:
        tests and bench.fused_ops_ab swap Kernels or switch fused libraries off."""
        return (
            self._kernels_unchanged(self._model_ref)
            and fused_ops._LIBRARIES[torch.float32]() is not None
            and (not self._model.kv_narrow or fused_ops._LIBRARIES[torch.bfloat16]() is not None)
        )

    def refresh(self) -> None:
        """Forgets the layer tables. The packed weights are fixed once loaded
        (weight_packing.py); whoever replaces a layer's `packed` (tests) calls this."""
        self._by_rows.clear()
        self._by_routes.clear()

    def _layers_for(self, rows: int) -> ctypes.Array | None:
        """The layer table for `rows` rows: None where some linear does not take
        a packed route. Row counts with the same routes share one table (routes
        change at a few thresholds; --deterministic steps see every row count)."""
        if rows not in self._by_rows:
            routes = tuple(route(rows, layer.packed.get(name)) for layer in self._model_ref.layers for name in LINEARS)
            if routes not in self._by_routes:
                native = all(how in _ROUTES for how in routes)
                self._by_routes[routes] = self._table(routes) if native else None
            entry = self._by_routes[routes]
            self._by_rows[rows] = None if entry is None else entry[0]
        return self._by_rows[rows]

    def _table(self, routes: tuple[str, ...]) -> tuple[ctypes.Array, list]:
        """(the layer table for `routes`, the PackedWeights its pointers point into)."""
        table = (_Layer * len(self._model_ref.layers))()
        hows, kept = iter(routes), []
        for entry, layer, (k_cache, v_cache) in zip(table, self._model_ref.layers, self._kv, strict=True):
            entry.input_norm, entry.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
            entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            for name in LINEARS:
                packed, how = layer.packed[name], next(hows)
                kept.append(packed)
                bias = _ptr(layer.qkv_bias if name == "qkv" else None)
                if how == "panels":
                    linear = _Linear(packed.panels.data_ptr(), bias, _PANELS, 0)
                elif how == "dot":
                    linear = _Linear(packed.blocks.data.data_ptr(), bias, _DOT, 0)
                else:
                    blocks = {
                        "blocks": packed.blocks,
                        "gguf": packed.gguf,
                        "gguf_dot": packed.gguf,
                        "int8": packed.gguf_blocks,
                    }[how]
                    code = {"int8": _INT8, "gguf_dot": _GGUF_DOT}.get(how, _BLOCKS)
                    linear = _Linear(blocks.data.data_ptr(), bias, code, BLOCK_FORMATS[blocks.kind][0])
                setattr(entry, name, linear)
        return table, kept

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor | None:
        """The final-normed hidden states [T, hidden] of the layers run over the
        embedded tokens `h` (updated in place, as the Python path updates it),
        or None, having done nothing, for a step the driver does not take."""
        assert kv_caches is self._kv, "a DecoderStack runs over the KV cache it was built for"
        plan = meta.extra.get(self._backend.name)
        if plan is None or plan.has_prefills or plan.decodes is None or not self._same_kernels():
            return None
        rows = h.shape[0]
        layers = self._layers_for(rows)
        if layers is None:
            return None
        assert h.dtype == torch.float32 and h.is_contiguous(), f"h {h.dtype} {h.stride()}"
        cos, sin_signed = cos.contiguous(), sin_signed.contiguous()
        d = plan.decodes
        if d.block_tables is not None:  # batch-invariant items: their own rows and lengths
            tables, seq_lens = d.block_tables, d.seq_lens
        else:
            tables = meta.block_tables.to(torch.int32)
            seq_lens = meta.seq_lens.to(torch.int32)
        assert tables.stride(1) == 1 and seq_lens.is_contiguous() and meta.slot_mapping.dtype == torch.int64
        slots = meta.slot_mapping.contiguous()
        need = self._lib.decoder_stack_scratch_floats(ctypes.byref(self._model), rows)
        if rows > _KEPT_SCRATCH_ROWS:  # a --deterministic prefill: this step's own, freed after it
            scratch = torch.empty(need, dtype=torch.float32)
        else:
            if self._scratch.numel() < need:
                self._scratch = torch.empty(need, dtype=torch.float32)
            scratch = self._scratch
        # The decode route may change after the stack is built (attention/routes.py
        # at start-up), and with it the kernel build and its arithmetic bits.
        self._model.attention = _address(self._backend._kernel)
        self._model.attention_flags = self._backend.decode_flags(self._kv[0][0].dtype)
        out = torch.empty_like(h)
        step = _Step(
            h=h.data_ptr(),
            out=out.data_ptr(),
            scratch=scratch.data_ptr(),
            cos=cos.data_ptr(),
            sin_signed=sin_signed.data_ptr(),
            slots=slots.data_ptr(),
            block_tables=tables.data_ptr(),
            seq_lens=seq_lens.data_ptr(),
            tokens=d.tokens.data_ptr(),
            seq_index=d.seq_index.data_ptr(),
            num_tokens=rows,
            table_stride=tables.stride(0),
            max_seq_len=d.max_seq_len,
            num_threads=torch.get_num_threads(),
        )
        status = self._lib.decoder_stack_forward(ctypes.byref(self._model), layers, ctypes.byref(step))
        if status == -2:
            raise IndexError(f"a KV slot outside the cache's {self._model.num_slots}: {slots.tolist()}")
        if status == -3:
            raise MemoryError("native decode attention could not allocate its scratch buffers")
        if status == -5:
            raise RuntimeError(f"decode route {self._backend.decode_route!r}: the kernel has no bf16 dot path here")
        if status != 0:
            raise RuntimeError(f"decoder_stack_forward: a kernel refused the step (status {status})")
        return out
