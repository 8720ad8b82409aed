"""Linear layers on CPU through the native packed GEMM (native/packed_gemm.c).

`pack(weight)` copies an [out, in] float32 weight once, at load, into the
panel order the kernel reads; `linear(x, weight, bias, PackedWeight(panels))`
multiplies through the kernel for 2-256 rows (decode batches, short prefill
chunks) and through F.linear (MKL) otherwise, or for every row count from 2
on where the kernel measured faster than MKL at prefill sizes at start-up
(`PackedWeight.native_max_rows`, float_gemm_rows.py: an AMD EPYC Zen 5,
whose MKL runs AVX2 kernels), so the model keeps both copies: the packed
one costs as much memory as the linear weights themselves. The model packs only where the kernel was built (x86 with
AVX-512), on CPU, for float32 weights or (below) bfloat16 ones.

`pack_blocks(rows)` also keeps a GGUF Q4_1 or Q8_0 weight in its blocks
(5 or 8.5 bits per weight), regrouped into panel order; the kernel expands
each panel 64 k at a time into an L1 buffer of float32, to the same values a
float32 load holds, so the outputs are the float32 panels' bit for bit while
a decode step reads 3.8-6.4x fewer bytes of weights. With block panels the
kernel takes 1-32 rows, single rows included (which without them go to MKL,
whose sums are ordered differently).

`pack_bf16(weight)` keeps a weight in bfloat16 blocks of the same layout,
which the kernel widens to float32 (exactly: a bfloat16 is the top half of a
float32). That is how `--dtype bfloat16` runs on CPUs without AVX512-BF16:
bfloat16 weights at half the bytes, float32 arithmetic at the float32 rate,
instead of torch's emulated bf16 GEMM (decode steps 1.4x slower at one row,
~2.8x at 8-64, prefill 3.5x, docs/optimization_log.md). Past BF16_MAX_ROWS rows
(or the measured PackedWeight.native_max_rows), where MKL's float32 GEMM was
faster than the kernel, the bfloat16 weight is widened for it on each call:
a transient float32 copy of that one weight.
A bfloat16 model from a GGUF file may also keep the file's Q4_1/Q8_0 blocks
beside its BF16 ones (`PackedWeight.gguf`, --gguf-blocks auto): 1 to
BLOCKS_MAX_ROWS rows read those instead, 5 or 8.5 bits per weight instead of
16, and multiply the file's exact values, so those outputs are the float32
model's block-path outputs bit for bit.

With --gguf-activations int8 (PackedWeight.int8_rows, CPUs with
AVX512-VNNI) every row count of a weight the file keeps in Q4_1/Q8_0 blocks
quantises its activations to int8 per 32 values and multiplies those blocks
with integer dot products (route "int8", int8_blocks.h): llama.cpp's
arithmetic, faster than the float paths from one row to a prefill chunk,
outputs no longer the float32 path's.

On CPUs with native bf16 arithmetic (AVX512-BF16, AMX) three more GEMMs
take bfloat16 activations: the kernel's VDPBF16PS loop over the same BF16
blocks ("dot", bf16_dot_gemm.h), its VDPBF16PS loop over the file's Q4_1
blocks ("gguf_dot", q4_dot_gemm.h) and oneDNN's bf16 GEMM over a second,
reordered copy of the weight ("onednn", onednn_linear.py). Which of them,
the BF16 blocks or the file's blocks takes each row count is measured at
start-up (bf16_gemm_routes.py) and kept in `PackedWeight.bf16_routes`.

Batch invariance (--deterministic, docs/determinism.md): the kernel sums
every output over k in one fixed FMA chain per row, whatever M, the row
tile, the chunk or the thread, so a row's result never depends on the other
rows; MKL picks its algorithm and blocking by M. A `batch_invariant`
PackedWeight therefore never routes to MKL: panels (or BF16 blocks) at
every row count, GGUF blocks where they apply (their outputs are the panels'
bit for bit), never oneDNN, the dot kernel or int8 activations (rounded activations,
another k order), and no file blocks beside bfloat16 ones (their values are
not the BF16 blocks').
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from executor_svc import onednn_linear
from executor_svc.native_build import load_library

SOURCE = os.path.join(os.path.dirname(__file__), "native", "packed_gemm.c")


@dataclass(frozen=True)
class _Kernel:
    gemm: ctypes._CFuncPtr
    gemm_blocks: ctypes._CFuncPtr
    gemm_bf16_dot: ctypes._CFuncPtr
    gemm_bf16_dot_warm: ctypes._CFuncPtr  # the same, warming spans of memory as it goes (decoder_stack.c)
    gemm_int8: ctypes._CFuncPtr
    gemm_quant_bf16_dot: ctypes._CFuncPtr
    gemm_bf16_dot_swiglu: ctypes._CFuncPtr  # the gate/up dot GEMM with SwiGLU on its tiles, bf16 out
    gemm_bf16_dot_argmax: ctypes._CFuncPtr  # the dot GEMM reduced to each row's argmax, C never written
    quantize_int8: ctypes._CFuncPtr
    panel_width: int  # output columns per packed panel
    bf16_dot_native: bool  # VDPBF16PS built and on this CPU; else the dot kernel is emulated
    int8_native: bool  # VPDPBUSD on this CPU: the int8-activation kernel runs (never emulated)


@lru_cache(maxsize=1)
def kernel() -> _Kernel | None:
    """The compiled kernel, or None where it cannot run (no compiler, no AVX-512)."""
    lib = load_library(SOURCE)  # typed from native_signatures.py
    if lib is None or lib.packed_gemm_panel_width() == 0:
        return None
    return _Kernel(
        lib.packed_gemm,
        lib.packed_gemm_quant,
        lib.packed_gemm_bf16_dot,
        lib.packed_gemm_bf16_dot_warm,
        lib.packed_gemm_quant_int8,
        lib.packed_gemm_quant_bf16_dot,
        lib.packed_gemm_bf16_dot_swiglu,
        lib.packed_gemm_bf16_dot_argmax,
        lib.quantize_rows_int8,
        lib.packed_gemm_panel_width(),
        lib.packed_gemm_bf16_dot_native() == 1,
        lib.packed_gemm_int8_native() == 1,
    )


# In this range of rows the packed kernel beats MKL over cold weights (1.2-1.5x
# at 8-256 rows, the linears of 30 layers); at one row both read the weights at
# full bandwidth, and past one row chunk (MC = 256 in packed_gemm.c) MKL was as
# fast or faster on the Xeons measured (docs/optimization_log.md). Past it, the
# start-up measurement decides (PackedWeight.native_max_rows).
PACKED_MIN_ROWS, PACKED_MAX_ROWS = 2, 256
# Block panels read 3.8-6.4x fewer bytes but expand them on every call: they win
# while the weights' DRAM stream dominates, 1.3-1.6x at 1-8 rows, and are even
# with the float32 panels (whose stream the prefetch hides) from ~32 rows on.
BLOCKS_MAX_ROWS = 32
# bfloat16 block panels have no float32 copy beside them: past this many rows
# MKL over the weight widened per call was faster on a Xeon (SmolLM2's four
# linears, 2 threads: the kernel 1.16x at 257 rows, 1.03-1.04x at 300-512,
# 0.96x at 1,024, 0.94x at 2,048; the widening is a fixed cost per call).
# Past it, the start-up measurement decides (PackedWeight.native_max_rows).
BF16_MAX_ROWS = 512

# --gguf-activations int8: 1..INT8_MAX_ROWS rows of a weight kept in Q4_1/Q8_0
# blocks quantise their activations to int8 and multiply the blocks with
# VPDPBUSD (int8_blocks.h): every row count, since it is the fastest GEMM at
# each, decode batches and prefill chunks alike (SmolLM2's block linears,
# one thread: 1.1x the float32 blocks at 1 row, 1.35x at 4, 1.9x at 8-32;
# two threads against MKL's float32: 1.6-2.7x at 32-128 rows, 1.4x at 2,048).
INT8_MAX_ROWS = 2**31 - 1
INT8_KINDS = ("Q4_1", "Q8_0")

# GGUF block formats the kernel reads: its format code, and the bytes of one
# block of 32 weights in the file (ggml's block_q4_1: f16 d, f16 m, 16 bytes
# of 4-bit codes, k = j in the low nibble of byte j and k = j + 16 in its high
# one; block_q8_0: f16 d, 32 int8 codes).
# "BF16" is no GGUF format: 32 bfloat16 weights of one output row in k order
# (regrouped by pack_blocks into k pairs per column, packed_gemm.c).
BLOCK_FORMATS = {"Q4_1": (1, 20), "Q8_0": (2, 34), "BF16": (3, 64)}
BLOCK_K = 32


@dataclass(frozen=True)
class BlockPanels:
    """An [out, in] weight in blocks (GGUF or bfloat16), in the kernel's panel order."""

    data: torch.Tensor  # uint8 [panels, in // 32, bytes per panel block]
    kind: str  # a key of BLOCK_FORMATS
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def pack_blocks(kind: str, rows: torch.Tensor) -> BlockPanels:
    """rows: uint8 [out, in // 32, block bytes], each output row's GGUF blocks
    in k order. Regroups them so that one block of one panel of 48 columns is
    contiguous (layout in packed_gemm.c); rows past `out` are zero, which
    expands to zero weights."""
    k = kernel()
    assert k is not None, "pack_blocks() called where the packed GEMM kernel is unavailable"
    assert kind in BLOCK_FORMATS, f"no block kernel for {kind!r}"
    block_bytes = BLOCK_FORMATS[kind][1]
    assert rows.dtype == torch.uint8 and rows.dim() == 3 and rows.shape[2] == block_bytes, (
        f"{kind} rows must be uint8 [out, in/32, {block_bytes}], got {rows.dtype} {tuple(rows.shape)}"
    )
    out_features, num_blocks, _ = rows.shape
    width = k.panel_width
    num_panels = -(-out_features // width)
    blocks = rows.new_zeros(num_panels * width, num_blocks, block_bytes)
    blocks[:out_features] = rows
    # [panel, column, block, byte] -> per (panel, block): each field column-minor.
    blocks = blocks.view(num_panels, width, num_blocks, block_bytes).transpose(1, 2)
    d = blocks[..., 0:2]  # [panel, block, column, 2]: f16 scales, column after column
    if kind == "BF16":  # [panel, block, k pair, column, 2 x 2 bytes]
        fields = [blocks.reshape(num_panels, num_blocks, width, BLOCK_K // 2, 4).transpose(2, 3)]
    else:  # codes: [panel, block, group g, column, byte i] = byte 4g + i of the column's codes
        codes = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]
        groups = codes.reshape(num_panels, num_blocks, width, -1, 4).transpose(2, 3)
        fields = [d, blocks[..., 2:4], groups] if kind == "Q4_1" else [d, groups]
    # A fresh torch tensor is 64-byte aligned: a 960-byte Q4_1 block spans
    # exactly the 15 lines expand_block prefetches.
    panels = torch.cat([f.reshape(num_panels, num_blocks, -1) for f in fields], dim=2)
    return BlockPanels(panels, kind, out_features, num_blocks * BLOCK_K)


def pack_bf16(weight: torch.Tensor) -> BlockPanels:
    """A bfloat16 CPU [out, in] weight (in a multiple of 32) as BF16 block panels."""
    assert weight.dtype == torch.bfloat16 and weight.device.type == "cpu", (
        f"pack_bf16 takes bfloat16 CPU weights, got {weight.dtype} on {weight.device}"
    )
    out_features, in_features = weight.shape
    assert in_features % BLOCK_K == 0, f"pack_bf16: in_features {in_features} is not a multiple of {BLOCK_K}"
    rows = weight.contiguous().view(torch.uint8).view(out_features, in_features // BLOCK_K, 2 * BLOCK_K)
    return pack_blocks("BF16", rows)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A float32 CPU [out, in] weight in panel order:
    panels[p, k, c] = weight[p * width + c, k], zero past `out`. The kernel must be available."""
    k = kernel()
    assert k is not None, "pack() called where the packed GEMM kernel is unavailable"
    assert weight.dtype == torch.float32 and weight.device.type == "cpu", (
        f"packed GEMM takes float32 CPU weights, got {weight.dtype} on {weight.device}"
    )
    out_features, in_features = weight.shape
    width = k.panel_width
    num_panels = -(-out_features // width)
    padded = weight.new_zeros(num_panels * width, in_features)
    padded[:out_features] = weight
    return padded.view(num_panels, width, in_features).transpose(1, 2).contiguous()


@dataclass(frozen=True)
class PackedWeight:
    """The kernel's copies of one [out, in] weight: float32 panels, and its
    GGUF blocks where the file has them; or bfloat16 blocks alone."""

    # pack(weight); None with pack_bf16 blocks; empty where int8 activations
    # take every row count (int8_rows == INT8_MAX_ROWS), since no route reads them.
    panels: torch.Tensor | None
    blocks: BlockPanels | None = None  # pack_blocks of the same weight's rows
    # With bfloat16 blocks on CPUs with native bf16: the weight in oneDNN's
    # layout (onednn_linear.py), where bf16_routes sends rows to "onednn".
    onednn: torch.Tensor | None = None
    # With bfloat16 blocks and a GGUF file: the file's Q4_1/Q8_0 blocks of the
    # same weight (pack_blocks), which take 1..BLOCKS_MAX_ROWS rows (or where
    # bf16_routes says "gguf" or, for Q4_1, "gguf_dot").
    gguf: BlockPanels | None = None
    # With bfloat16 blocks on CPUs with native bf16: (from_rows, how) pairs,
    # from_rows ascending, measured at start-up (bf16_gemm_routes.py); `rows`
    # goes to the `how` of the last pair with from_rows <= rows.
    bf16_routes: tuple[tuple[int, str], ...] = ()
    batch_invariant: bool = False  # never MKL: every row count through the kernel
    # --gguf-activations int8: 1..int8_rows rows quantise their activations to
    # int8 and multiply the GGUF blocks (`blocks` beside float32 panels, `gguf`
    # beside bfloat16 ones) instead of any float route (route "int8"); 0 = never.
    int8_rows: int = 0
    # Up to how many rows the kernel's float32 arithmetic (panels, or BF16
    # blocks where no bf16 route applies) takes before MKL does; 0 = the
    # fixed default (PACKED_MAX_ROWS, BF16_MAX_ROWS). Measured at start-up
    # (float_gemm_rows.py).
    native_max_rows: int = 0

    def __post_init__(self) -> None:
        assert self.panels is not None or self.blocks is not None, "a PackedWeight with neither panels nor blocks"
        assert self.panels is None or self.panels.numel() or self.int8_rows == INT8_MAX_ROWS, (
            "float32 panels are left out only where int8 activations take every row count"
        )
        assert self.gguf is None or (self.panels is None and self.blocks.kind == "BF16"), (
            "GGUF blocks beside float32 panels go in `blocks`; `gguf` is for bfloat16 weights"
        )
        assert not self.bf16_routes or (self.panels is None and not self.batch_invariant), (
            "bf16_routes are for bfloat16 blocks outside --deterministic"
        )
        assert all(how in BF16_ROUTES for _, how in self.bf16_routes), f"unknown route in {self.bf16_routes}"
        assert not self.int8_rows or (
            not self.batch_invariant and self.gguf_blocks is not None and self.gguf_blocks.kind in INT8_KINDS
        ), "int8 activations need Q4_1/Q8_0 blocks and no --deterministic"

    @property
    def gguf_blocks(self) -> BlockPanels | None:
        """The file's blocks of this weight: `blocks` beside float32 panels, `gguf` beside bfloat16 ones."""
        return self.blocks if self.panels is not None else self.gguf


# What bf16_routes may name: the kernel over the BF16 blocks (float32
# arithmetic), over the file's blocks, its VDPBF16PS loop over either
# (the file's only where they are Q4_1), or oneDNN.
BF16_ROUTES = ("blocks", "gguf", "dot", "gguf_dot", "onednn")
GGUF_DOT_KINDS = ("Q4_1",)


def route(rows: int, packed: PackedWeight | None) -> str:
    """Which GEMM multiplies `rows` rows: "blocks" (the kernel over `packed.blocks`),
    "gguf" (over `packed.gguf`), "int8" (int8 activations over the GGUF blocks,
    where `packed.int8_rows` allows), "dot" (the bf16 dot-product kernel over
    `packed.blocks`), "gguf_dot" (over `packed.gguf`), "panels", "onednn" or
    "torch" (MKL)."""
    if packed is not None and 1 <= rows <= packed.int8_rows:
        return "int8"
    return _float_route(rows, packed)


def _float_route(rows: int, packed: PackedWeight | None) -> str:
    if packed is None:
        return "torch"
    if packed.panels is None:  # bfloat16 weights
        if packed.bf16_routes:
            how = "blocks"
            for from_rows, name in packed.bf16_routes:
                if rows >= from_rows:
                    how = name
            # A weight the file keeps in blocks the dot loop cannot read (the
            # head's Q8_0) takes the float32 loop over them; one it does not
            # keep in blocks, or kept no oneDNN copy of, reads its BF16 blocks.
            if how == "gguf_dot" and packed.gguf is not None and packed.gguf.kind not in GGUF_DOT_KINDS:
                how = "gguf"
            if (how in ("gguf", "gguf_dot") and packed.gguf is None) or (how == "onednn" and packed.onednn is None):
                how = "blocks"
            if how != "blocks":
                return how
        elif packed.gguf is not None and 1 <= rows <= BLOCKS_MAX_ROWS:
            return "gguf"
        return "blocks" if rows <= (packed.native_max_rows or BF16_MAX_ROWS) or packed.batch_invariant else "torch"
    if packed.blocks is not None and 1 <= rows <= BLOCKS_MAX_ROWS:
        return "blocks"
    if PACKED_MIN_ROWS <= rows <= (packed.native_max_rows or PACKED_MAX_ROWS) or packed.batch_invariant:
        return "panels"
    return "torch"


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: PackedWeight | None = None
) -> torch.Tensor:
    """x [M, in] @ weight.T (+ bias) -> [M, out]: through the packed kernel
    where `route` picks it, else F.linear (widening a bfloat16 weight for a
    float32 x). Block panels and float32 panels give the same result bit for bit."""
    how = route(x.shape[0], packed)
    if how == "torch":
        return F.linear(x, weight.to(x.dtype), bias)
    if how == "onednn":
        return onednn_linear.linear(x, packed.onednn, bias)
    if how == "dot":
        return _bf16_dot(x, weight, bias, packed.blocks)
    if how == "gguf_dot":
        return _gguf_dot(x, weight, bias, packed.gguf)
    out_features, in_features = weight.shape
    assert x.dim() == 2 and x.shape[1] == in_features and x.dtype == torch.float32, (
        f"packed linear: input {tuple(x.shape)} {x.dtype} vs weight {tuple(weight.shape)}"
    )
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        assert bias.is_contiguous() and bias.shape == (out_features,), f"bias shape {tuple(bias.shape)}"
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    bias_ptr = None if bias is None else bias.data_ptr()
    if how in ("blocks", "gguf", "int8"):
        # int8: the same blocks and arguments; the kernel quantises x to int8
        # per row and block of 32 k first (int8_blocks.h).
        blocks = {"blocks": packed.blocks, "gguf": packed.gguf, "int8": packed.gguf_blocks}[how]
        assert (blocks.out_features, blocks.in_features) == (out_features, in_features), (
            f"block panels of a {blocks.out_features}x{blocks.in_features} weight used for {tuple(weight.shape)}"
        )
        assert how != "int8" or blocks.kind in INT8_KINDS, f"int8 activations over {blocks.kind} blocks"
        gemm = kernel().gemm_int8 if how == "int8" else kernel().gemm_blocks
        status = gemm(
            out.data_ptr(),
            out.stride(0),
            x.data_ptr(),
            x.stride(0),
            blocks.data.data_ptr(),
            BLOCK_FORMATS[blocks.kind][0],
            bias_ptr,
            x.shape[0],
            out_features,
            in_features,
            torch.get_num_threads(),
        )
        assert status == 0, f"{how} GEMM returned {status} for {blocks.kind} {out_features}x{in_features}"
    else:
        panels = packed.panels
        assert (
            panels.dim() == 3 and panels.shape[1] == in_features and panels.shape[0] * panels.shape[2] >= out_features
        ), f"panels {tuple(panels.shape)} do not pack a {tuple(weight.shape)} weight"
        kernel().gemm(
            out.data_ptr(),
            out.stride(0),
            x.data_ptr(),
            x.stride(0),
            panels.data_ptr(),
            bias_ptr,
            x.shape[0],
            out_features,
            in_features,
            torch.get_num_threads(),
        )
    return out


def _bf16_dot(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, blocks: BlockPanels) -> torch.Tensor:
    """x [M, in] rounded to bfloat16 @ the BF16 blocks' weight (+ bias) -> float32
    [M, out] through the kernel's dot-product loop: VDPBF16PS where the CPU
    has it, its emulation in AVX-512F elsewhere (tests; never routed there)."""
    out_features, in_features = weight.shape
    assert x.dim() == 2 and x.shape[1] == in_features, f"dot linear: input {tuple(x.shape)} vs {tuple(weight.shape)}"
    assert blocks.kind == "BF16" and (blocks.out_features, blocks.in_features) == (out_features, in_features)
    assert bias is None or (bias.is_contiguous() and bias.dtype == torch.float32 and bias.shape == (out_features,))
    k = kernel()
    xb = x.to(torch.bfloat16).contiguous()
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    status = k.gemm_bf16_dot(
        out.data_ptr(),
        out.stride(0),
        xb.data_ptr(),
        xb.stride(0),
        blocks.data.data_ptr(),
        None if bias is None else bias.data_ptr(),
        x.shape[0],
        out_features,
        in_features,
        int(k.bf16_dot_native),
        torch.get_num_threads(),
    )
    assert status == 0, f"packed_gemm_bf16_dot returned {status} for {out_features}x{in_features}"
    return out


def _gguf_dot(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, blocks: BlockPanels) -> torch.Tensor:
    """x [M, in] rounded to bfloat16 @ the file's Q4_1 blocks (+ bias) ->
    float32 [M, out] through the kernel's VDPBF16PS loop over them
    (q4_dot_gemm.h); only where the CPU has the instruction."""
    out_features, in_features = weight.shape
    assert x.dim() == 2 and x.shape[1] == in_features and x.dtype == torch.float32, (
        f"gguf_dot linear: input {tuple(x.shape)} {x.dtype} vs weight {tuple(weight.shape)}"
    )
    assert blocks.kind in GGUF_DOT_KINDS and (blocks.out_features, blocks.in_features) == (out_features, in_features)
    assert bias is None or (bias.is_contiguous() and bias.dtype == torch.float32 and bias.shape == (out_features,))
    if x.stride(1) != 1:
        x = x.contiguous()
    k = kernel()
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    status = k.gemm_quant_bf16_dot(
        out.data_ptr(),
        out.stride(0),
        x.data_ptr(),
        x.stride(0),
        blocks.data.data_ptr(),
        BLOCK_FORMATS[blocks.kind][0],
        None if bias is None else bias.data_ptr(),
        x.shape[0],
        out_features,
        in_features,
        int(k.bf16_dot_native),
        torch.get_num_threads(),
    )
    assert status == 0, f"packed_gemm_quant_bf16_dot returned {status} for {out_features}x{in_features}"
    return out


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int8 route's activations for float32 x [M, K]: (int8 codes [M, K],
    scale [M, K/32], scale x sum of codes [M, K/32]), as the kernel computes them."""
    assert x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] % BLOCK_K == 0, f"{tuple(x.shape)} {x.dtype}"
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.int8)
    scale, total = torch.empty(rows, k // BLOCK_K), torch.empty(rows, k // BLOCK_K)
    status = kernel().quantize_int8(
        q.data_ptr(), scale.data_ptr(), total.data_ptr(), x.data_ptr(), x.stride(0), rows, k
    )
    assert status == 0, f"quantize_rows_int8 returned {status}"
    return q, scale, total
