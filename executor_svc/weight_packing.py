"""CPU weight repacking for the native GEMM (packed_linear.py), applied to a
loaded model as a post-load hook (`apply`, called by model_loader.py).

The model (model.py) is the architecture only: it keeps empty slots for the
kernel's copies (`DecoderLayer.packed` by weight name, the head's
`_head_packed`) and uses whatever is in them. This module fills them:

    float32 model   pack_linear_weights: float32 panels of every linear
                    weight and the head (plus their GGUF Q4_1/Q8_0 blocks,
                    where the file has them), beside the weights
    bfloat16 model  widen_bf16: bfloat16 block panels, float32 arithmetic
                    (for CPUs without AVX512-BF16), plus the GGUF Q4_1/Q8_0
                    blocks for small batches where the file has them

Either runs once, after load_weights and before the first forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from executor_svc import onednn_linear
from executor_svc.model import LINEAR_PARTS, LlamaForCausalLM
from executor_svc.packed_linear import (
    BLOCK_K,
    INT8_KINDS,
    INT8_MAX_ROWS,
    BlockPanels,
    PackedWeight,
    pack,
    pack_bf16,
    pack_blocks,
    route,
)
from executor_svc.rope import rope_cache

# GGUFCheckpoint.blocks: (kind, uint8 rows) of a tensor the file keeps in blocks, else None.
BlockSource = Callable[[str], tuple[str, torch.Tensor] | None]
# The measured bf16 routes (bf16_gemm_routes.py) of a weight whose file
# blocks are of this kind (None: no file blocks): the float32 loop over
# Q8_0 blocks and the dot loop, which reads Q4_1 only, win at other row
# counts than over Q4_1, so each kind is measured for itself.
RoutesByKind = Callable[[str | None], tuple[tuple[int, str], ...]]


def no_routes(kind: str | None) -> tuple[tuple[int, str], ...]:
    """RoutesByKind where nothing was measured: the widened model's defaults."""
    return ()


# PackedWeight.native_max_rows for a kind of kernel weights
# (float_gemm_rows.KINDS: "panels" or "bf16"), measured at start-up.
NativeRows = Callable[[str], int]


def default_native_rows(kind: str) -> int:
    """NativeRows where nothing was measured: packed_linear's fixed defaults."""
    return 0


def _with_native_rows(packed: PackedWeight, native_rows: NativeRows, kind: str) -> PackedWeight:
    """`packed` with native_max_rows from `native_rows(kind)`, asked only where
    MKL would take its large row counts (not where int8 activations, the
    file's blocks, a bf16 route or --deterministic take them all)."""
    if route(2**30, packed) != "torch":
        return packed
    return dataclasses.replace(packed, native_max_rows=native_rows(kind))


def apply(
    model: LlamaForCausalLM,
    blocks: BlockSource | None = None,
    bf16_routes: RoutesByKind = no_routes,
    batch_invariant: bool = False,
    int8_rows: int = 0,
    native_rows: NativeRows = default_native_rows,
) -> None:
    """The post-load hook: packs a float32 CPU model's weights or widens a
    bfloat16 one (with the measured `bf16_routes`), either
    with the GGUF `blocks` where given; `batch_invariant` (--deterministic)
    sends every row count through the kernel (packed_linear.py). With
    `int8_rows`, 1..int8_rows rows over Q4_1/Q8_0 blocks take int8
    activations (PackedWeight.int8_rows; the caller checked the CPU and the
    options, machine.gguf_int8_rows). `native_rows` gives the row count up to
    which the kernel's float32 arithmetic takes prefill chunks from MKL
    (PackedWeight.native_max_rows). The caller has checked that the kernel
    is available (machine.use_packed_gemm)."""
    assert not (int8_rows and batch_invariant), "int8 activations are not batch invariant"
    if model.embed_tokens.dtype == torch.bfloat16:
        widen_bf16(model, bf16_routes, blocks, batch_invariant, int8_rows, native_rows)
    else:
        pack_linear_weights(model, blocks, batch_invariant, int8_rows, native_rows)


@torch.no_grad()
def pack_linear_weights(
    model: LlamaForCausalLM,
    blocks: BlockSource | None = None,
    batch_invariant: bool = False,
    int8_rows: int = 0,
    native_rows: NativeRows = default_native_rows,
) -> None:
    """Adds the native CPU GEMM's packed copy of every linear weight and of
    the head (packed_linear.py), after load_weights, on float32 CPU models
    where the kernel was built. It doubles the linear weights' memory
    (plus the blocks, where kept: 5/32 or 8.5/32 of their float32 size),
    except where int8 activations take every row count of a weight's
    blocks (`int8_rows` = INT8_MAX_ROWS): no route reads its panels there,
    so none are made.

    `blocks(hf_name)` (GGUFCheckpoint.blocks), where given, also keeps the
    weights that the file stores as Q4_1 or Q8_0 in their blocks, for the
    kernel's small-batch path: a fused weight only if all its parts are
    blocks of one kind, and a row-parallel shard only if it starts on a
    block boundary. Their outputs are the panels' bit for bit, so
    `batch_invariant` keeps them. `native_rows("panels")` is the panels'
    PackedWeight.native_max_rows (asked only where MKL would take rows)."""
    assert model.embed_tokens.device.type == "cpu" and model.embed_tokens.dtype == torch.float32, (
        f"packing needs a float32 CPU model, not {model.embed_tokens.dtype} on {model.embed_tokens.device}"
    )
    for i, layer in enumerate(model.layers):
        layer.packed = {}
        for name, (parts, split) in LINEAR_PARTS.items():
            weight = getattr(layer, f"{name}_weight")
            names = [f"model.layers.{i}.{part}.weight" for part in parts]
            found = _block_panels(model, blocks, names, split, weight)
            layer.packed[name] = _float32_packed(
                weight, found, batch_invariant, _int8_rows(found, int8_rows), native_rows
            )
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    head_name = "model.embed_tokens.weight" if model.lm_head is None else "lm_head.weight"
    found = _block_panels(model, blocks, [head_name], None, head)
    model._head_packed = _float32_packed(head, found, batch_invariant, _int8_rows(found, int8_rows), native_rows)


def _float32_packed(
    weight: torch.Tensor, found: BlockPanels | None, batch_invariant: bool, int8_rows: int, native_rows: NativeRows
) -> PackedWeight:
    panels = torch.empty(0) if int8_rows == INT8_MAX_ROWS else pack(weight)  # no route reads panels then
    packed = PackedWeight(panels, found, batch_invariant=batch_invariant, int8_rows=int8_rows)
    return _with_native_rows(packed, native_rows, "panels")


@torch.no_grad()
def widen_bf16(
    model: LlamaForCausalLM,
    bf16_routes: RoutesByKind = no_routes,
    blocks: BlockSource | None = None,
    batch_invariant: bool = False,
    int8_rows: int = 0,
    native_rows: NativeRows = default_native_rows,
) -> None:
    """Runs a bfloat16 CPU model in float32 arithmetic over its bfloat16
    weights: on CPUs without AVX512-BF16 (where torch emulates bf16 GEMMs
    at a third of the float32 rate), and on CPUs with it, whose bf16 GEMMs
    win only once enough rows make them compute-bound (bf16_gemm_routes.py),
    while every other op has a native float32 kernel and no bf16 one. After load_weights: every linear
    weight and the head are also packed into BF16 block panels, which the
    kernel widens to float32 exactly as it reads them (the bfloat16
    tensors stay, widened per call for MKL, which takes the larger row
    counts where it measured faster); the norms, biases and rope tables become float32, as do the
    activations from the embedding lookup on. So the weights keep their
    bfloat16 values, in as many bytes as float32 weights alone (half what
    a float32 model keeps beside its panels); only the arithmetic is
    float32. A weight whose input width is not a multiple of 32 (possible
    in a tensor-parallel shard) is widened to a float32 tensor instead.
    With `bf16_routes` (CPUs with native bf16, measured at start-up for
    the kind of file blocks a weight has), each packed weight routes its row
    counts so (PackedWeight.bf16_routes), and is also kept in oneDNN's
    layout where a route names oneDNN. `native_rows("bf16")` is their
    PackedWeight.native_max_rows: how many rows the kernel's float32 loop
    over them takes before MKL over the widened weight does.

    `blocks(hf_name)` (GGUFCheckpoint.blocks), where given, also keeps the
    weights the file stores as Q4_1/Q8_0 in their blocks (as for float32
    models, same conditions), which 1..BLOCKS_MAX_ROWS rows (or the row
    counts bf16_routes gives them) read instead of the BF16 ones (packed_linear.route): 5 or 8.5
    bits a weight instead of 16, and the file's exact values where the
    bfloat16 weights hold them rounded. They cost 5/16 or 8.5/16 of the
    bfloat16 weights' memory on top. With `int8_rows`, 1..int8_rows rows
    multiply them with int8 activations instead (as for float32 models).

    `batch_invariant` (--deterministic): every row count through the kernel
    over the BF16 blocks, so no bf16_routes (oneDNN and the dot kernel
    round activations) and no file blocks (whose values differ from the BF16 ones); a weight widened to float32 for its
    width is packed into float32 panels instead of going to MKL.
    """
    if batch_invariant:
        bf16_routes, blocks = no_routes, None
    assert model.embed_tokens.device.type == "cpu" and model.embed_tokens.dtype == torch.bfloat16, (
        f"widen_bf16 needs a bfloat16 CPU model, not {model.embed_tokens.dtype} on {model.embed_tokens.device}"
    )

    def packed(owner: nn.Module, attr: str, names: list[str], split: int | None = None) -> PackedWeight | None:
        weight = getattr(owner, attr)
        if weight.shape[1] % BLOCK_K:
            wide = weight.float()
            setattr(owner, attr, nn.Parameter(wide, requires_grad=False))
            return PackedWeight(pack(wide), None, batch_invariant=True) if batch_invariant else None
        return bf16_packed(weight, names, split)

    def bf16_packed(weight: torch.Tensor, names: list[str], split: int | None = None) -> PackedWeight:
        gguf = _block_panels(model, blocks, names, split, weight)
        routes = bf16_routes(None if gguf is None else gguf.kind)
        onednn = onednn_linear.pack(weight) if any(how == "onednn" for _, how in routes) else None
        packed = PackedWeight(
            None,
            pack_bf16(weight),
            onednn,
            gguf,
            bf16_routes=routes,
            batch_invariant=batch_invariant,
            int8_rows=_int8_rows(gguf, int8_rows),
        )
        return _with_native_rows(packed, native_rows, "bf16")

    for i, layer in enumerate(model.layers):
        layer.packed = {}
        for name, (parts, split) in LINEAR_PARTS.items():
            p = packed(layer, f"{name}_weight", [f"model.layers.{i}.{part}.weight" for part in parts], split)
            if p is not None:
                layer.packed[name] = p
        for attr in ("input_norm", "post_norm", "qkv_bias"):
            if getattr(layer, attr) is not None:
                setattr(layer, attr, nn.Parameter(getattr(layer, attr).float(), requires_grad=False))
    model.norm = nn.Parameter(model.norm.float(), requires_grad=False)
    if model.lm_head is not None:
        model._head_packed = packed(model, "lm_head", ["lm_head.weight"])
    elif model.config.hidden_size % BLOCK_K == 0:  # the embedding stays bfloat16 for lookups
        model._tied_head, model._head_packed = None, bf16_packed(model.embed_tokens, ["model.embed_tokens.weight"])
    else:
        model._tied_head = model.embed_tokens.float().t().contiguous().t()
        if batch_invariant:
            model._head_packed = PackedWeight(pack(model._tied_head), None, batch_invariant=True)
    model.rope_cos, model.rope_sin_signed = rope_cache(model.config, torch.float32, model.rope_cos.device)
    model.compute_dtype = torch.float32


def _int8_rows(blocks: BlockPanels | None, int8_rows: int) -> int:
    """int8_rows for a weight whose file blocks are `blocks`: 0 unless Q4_1/Q8_0."""
    return int8_rows if blocks is not None and blocks.kind in INT8_KINDS else 0


def block_panel_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of weights kept in block panels for the packed GEMM: GGUF
    blocks, bfloat16 ones after widen_bf16, or both (0 without them)."""
    packed = [p for layer in model.layers for p in layer.packed.values()] + [model._head_packed]
    return sum(b.nbytes for p in packed if p is not None for b in (p.blocks, p.gguf) if b is not None)


def _block_panels(
    model: LlamaForCausalLM, blocks: BlockSource | None, names: list[str], split: int | None, weight: torch.Tensor
):
    """This rank's share of the named weights' GGUF blocks, concatenated by
    rows and packed; None where any part is not in blocks (see above)."""
    if blocks is None:
        return None
    found = [blocks(name) for name in names]
    if any(f is None for f in found) or len({kind for kind, _ in found}) != 1:
        return None
    shares = []
    for _, rows in found:
        if split is not None and model.tp_size > 1:
            if rows.shape[split] % model.tp_size:
                return None  # a shard boundary inside a block
            share = rows.shape[split] // model.tp_size
            rows = rows.narrow(split, model.tp_rank * share, share)
        shares.append(rows)
    rows = torch.cat(shares)
    assert (rows.shape[0], rows.shape[1] * BLOCK_K) == tuple(weight.shape), (
        f"{names}: blocks {tuple(rows.shape)} do not hold a {tuple(weight.shape)} weight"
    )
    return pack_blocks(found[0][0], rows)
