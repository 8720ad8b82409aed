"""Weights and config from a llama.cpp GGUF file.

Tensors are dequantized one at a time, on request, under transformers'
names (see model.load_weights), so at most one float32 copy of a tensor
exists beside the model's own weights:

    model.embed_tokens.weight               <- token_embd.weight
    model.layers.N.self_attn.q_proj.weight  <- blk.N.attn_q.weight  (rope rows un-permuted)
    model.layers.N.mlp.gate_proj.weight     <- blk.N.ffn_gate.weight
    ...                                          (table below)

llama.cpp's converter reorders the rows of Q and K in Llama models so that
its rope pairs adjacent elements (GPT-J style) where HF pairs element i with
i + head_dim/2. Within each head, HF row (j, i) [j in 0..1, i in 0..D/2]
becomes GGUF row (i, j); we apply the inverse, as transformers' GGUF loader
does. Qwen2 files are not permuted (llama.cpp runs them with NeoX rope).

`blocks(name)` hands out a Q4_1 or Q8_0 weight still in its blocks, for the
native GEMM that reads them as they are (packed_linear.pack_blocks).
"""

from __future__ import annotations

import re
from typing import Any

import gguf
import numpy as np
import torch

from executor_svc.model_config import ModelConfig
from executor_svc.packed_linear import BLOCK_FORMATS

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


def gguf_tensor_name(hf_name: str) -> str | None:
    """The llama.cpp name for a transformers tensor name, or None if it has none."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    match = _LAYER_RE.fullmatch(hf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"blk.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


class GGUFCheckpoint:
    """An open GGUF file: its ModelConfig and a by-name tensor source for model.load_weights."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._reader = gguf.GGUFReader(path)
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.metadata = _scalar_metadata(self._reader)
        # ggml lists dimensions innermost first; torch order is the reverse.
        shapes = {name: tuple(int(d) for d in reversed(t.shape.tolist())) for name, t in self._tensors.items()}
        self.config = ModelConfig.from_gguf_metadata(self.metadata, shapes)

    def _entry(self, hf_name: str):
        name = gguf_tensor_name(hf_name)
        if name is None or name not in self._tensors:
            raise ValueError(f"{self.path}: missing tensor {hf_name!r} (GGUF name {name!r})")
        return name, self._tensors[name]

    def _rope_heads(self, name: str) -> int | None:
        """Heads of a Q or K projection whose rows llama.cpp permuted; None for any other tensor."""
        if self.config.architecture == "llama" and name.endswith((".attn_q.weight", ".attn_k.weight")):
            cfg = self.config
            return cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads
        return None

    def blocks(self, hf_name: str) -> tuple[str, torch.Tensor] | None:
        """(kind, uint8 [rows, in / 32, block bytes]): a Q4_1 or Q8_0 weight's
        GGUF blocks, rows in HF order; None for any other storage type (the
        packed GEMM's block panels, packed_linear.pack_blocks)."""
        name, entry = self._entry(hf_name)
        kind = entry.tensor_type.name
        if kind not in BLOCK_FORMATS or len(entry.shape) != 2:
            return None
        block_bytes = BLOCK_FORMATS[kind][1]
        rows = np.asarray(entry.data)
        rows = torch.from_numpy(rows.reshape(rows.shape[0], -1, block_bytes).copy())
        heads = self._rope_heads(name)
        return kind, rows if heads is None else _unpermute_rope_rows(rows, heads)

    def tensor(self, hf_name: str) -> torch.Tensor:
        """The dequantized float32 tensor HF calls `hf_name`; ValueError if the file lacks it."""
        name, entry = self._entry(hf_name)
        array = gguf.quants.dequantize(entry.data, entry.tensor_type)
        if not array.flags.writeable:  # unquantized tensors come back as views of the memory map
            array = np.array(array)
        weight = torch.from_numpy(array)
        assert weight.dtype == torch.float32, f"dequantize gave {weight.dtype} for {name}"
        heads = self._rope_heads(name)
        return weight if heads is None else _unpermute_rope_rows(weight, heads)


def _unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows reordered; any trailing dimensions (columns, or a row's blocks) move with their row."""
    rows, rest = weight.shape[0], weight.shape[1:]
    half = rows // num_heads // 2
    assert half * 2 * num_heads == rows, f"{rows} rows do not split into {num_heads} heads of even size"
    return weight.view(num_heads, half, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def _scalar_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every metadata key except arrays (the vocabulary is read by the tokenizer, not here)."""
    metadata = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] != gguf.GGUFValueType.ARRAY:
            metadata[key] = field.contents()
    return metadata
