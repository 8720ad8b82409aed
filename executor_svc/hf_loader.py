"""Weights and config from a local Hugging Face model folder.

    folder/
      config.json                      -> ModelConfig.from_hf_config
      generation_config.json           (optional) extra eos_token_id entries
      model.safetensors                 single file, or
      model.safetensors.index.json      {"weight_map": {tensor name: shard file}} + shards

Tensors keep their HF names, which is what model.load_weights asks for. Only
safetensors are read (no pickled *.bin: loading those runs arbitrary code).
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch
from safetensors import safe_open

from executor_svc.model_config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"


class HFCheckpoint:
    """An HF folder: its ModelConfig and a by-name tensor source for model.load_weights."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        hf_config = _read_json(os.path.join(folder, "config.json"))
        config = ModelConfig.from_hf_config(hf_config, model_name=folder_model_name(folder))
        generation = os.path.join(folder, "generation_config.json")
        if os.path.isfile(generation):
            config = _with_generation_eos(config, _read_json(generation))
        self.config = config
        self._file_of = _tensor_files(folder)
        self._open: dict[str, object] = {}

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor called `name`; ValueError naming it if no shard has it."""
        file = self._file_of.get(name)
        if file is None:
            raise ValueError(f"{self.folder}: missing tensor {name!r}")
        if file not in self._open:
            self._open[file] = safe_open(os.path.join(self.folder, file), framework="pt")
        return self._open[file].get_tensor(name)


def folder_model_name(folder: str) -> str:
    """The folder's name; for a snapshot in the Hugging Face cache
    (.../models--Qwen--Qwen2.5-0.5B/snapshots/<commit>) the repo id, "Qwen/Qwen2.5-0.5B"."""
    path = os.path.normpath(os.path.abspath(folder))
    parent = os.path.dirname(path)
    repo = os.path.basename(os.path.dirname(parent))
    if os.path.basename(parent) == "snapshots" and repo.startswith("models--"):
        return repo[len("models--") :].replace("--", "/")
    return os.path.basename(path)


def _tensor_files(folder: str) -> dict[str, str]:
    """Tensor name -> safetensors file (relative to folder)."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        missing = sorted({f for f in weight_map.values() if not os.path.isfile(os.path.join(folder, f))})
        if missing:
            raise ValueError(f"{index} names shard files that do not exist: {', '.join(missing)}")
        return dict(weight_map)
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors weights (pickled *.bin checkpoints are not supported)")
    file_of = {}
    for file in files:
        with safe_open(os.path.join(folder, file), framework="pt") as f:
            for name in f.keys():
                file_of[name] = file
    return file_of


def _with_generation_eos(config: ModelConfig, generation: dict) -> ModelConfig:
    """Instruct models often list their end-of-turn tokens only in generation_config.json."""
    eos = generation.get("eos_token_id")
    extra = [eos] if isinstance(eos, int) else list(eos or [])
    merged = tuple(dict.fromkeys([*config.eos_token_ids, *(int(i) for i in extra)]))
    return dataclasses.replace(config, eos_token_ids=merged)


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise ValueError(f"missing {path}")
    with open(path, encoding="utf-8") as f:
        return json.load(f)
