"""The id a model is served under: in /v1/models and in the metrics' `model_name` label."""

from __future__ import annotations

import re


def model_id(model_name: str) -> str:
    """The model's name as a URL-safe slug ("Smollm2 135M 8k" -> "smollm2-135m-8k"; a Hugging Face
    id keeps its slash: "Qwen/Qwen2.5-0.5B" -> "qwen/qwen2.5-0.5b"); --served-model-name overrides it."""
    return re.sub(r"[^a-z0-9._/-]+", "-", model_name.lower()).strip("-/") or "model"
