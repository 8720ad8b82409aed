"""--deterministic, part by part: each op whose sums run across a row gives a row
the same bits whatever else is in the batch. The packed linear at every row
count and thread count, the CPU and Triton attention of a token decoded or in
any prefill chunk, and a seeded sampler row alone or in any batch. The whole
(a request's tokens and logprobs through the runner and the servers):
test_deterministic.py.

The Triton kernels run in Triton's interpreter without a GPU (TRITON_INTERPRET=1,
set by tests/conftest.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from executor_svc import packed_linear
from executor_svc.attention import get_backend
from executor_svc.attention.reference import attend_in_steps
from executor_svc.sampler import Sampler, build_sampling_metadata
from shared.sampling_params import SamplingParams

NATIVE = packed_linear.kernel() is not None and get_backend("cpu").name == "cpu"
needs_native = pytest.mark.skipif(not NATIVE, reason="--deterministic needs the AVX-512 native kernels")
GREEDY = SamplingParams(temperature=0.0, logprobs=2)
SEEDED = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, seed=1234, logprobs=2)


@needs_native
@pytest.mark.parametrize("kind", ["float32 panels", "Q8_0 blocks", "bfloat16 blocks"])
def test_a_batch_invariant_linear_row_is_the_same_at_every_row_count_and_thread_count(kind):
    import gguf

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(100, 96, generator=gen)
    if kind == "bfloat16 blocks":
        weight = weight.bfloat16()
        packed = packed_linear.PackedWeight(None, packed_linear.pack_bf16(weight), batch_invariant=True)
    else:
        blocks = None
        if kind == "Q8_0 blocks":
            rows = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0)
            weight = torch.from_numpy(gguf.quants.dequantize(rows, gguf.GGMLQuantizationType.Q8_0).copy())
            blocks = packed_linear.pack_blocks("Q8_0", torch.from_numpy(rows).view(100, 3, 34))
        packed = packed_linear.PackedWeight(packed_linear.pack(weight), blocks, batch_invariant=True)
    x = torch.randn(700, 96, generator=gen)
    alone = packed_linear.linear(x[:1], weight, None, packed)
    for m in (2, 31, 33, 256, 257, 513, 700):
        assert packed_linear.route(m, packed) != "torch"
        assert torch.equal(packed_linear.linear(x[:m], weight, None, packed)[:1], alone), m
    full = packed_linear.linear(x, weight, None, packed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        assert torch.equal(packed_linear.linear(x, weight, None, packed), full)
    finally:
        torch.set_num_threads(threads)
    # Without the flag, past the kernel's row range MKL takes over: the mode is what makes the difference.
    assert packed_linear.route(700, dataclasses.replace(packed, batch_invariant=False)) == "torch"


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 32], ids=["avx512-path", "portable-path"])
def test_cpu_attention_of_a_token_is_the_same_decoded_or_in_any_prefill_chunk(dtype, head_dim):
    backend = get_backend("cpu", batch_invariant=True)
    seq_len = 45
    decoded = attend_in_steps(backend, [1] * seq_len, dtype, seq_len, head_dim)
    for chunks, others in (([seq_len], 0), ([5] * 9, 0), ([16] * 3, 3), ([1, 30, 14], 2)):
        out = attend_in_steps(backend, chunks, dtype, seq_len, head_dim, others)
        assert torch.equal(out, decoded), (chunks, others)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_triton_attention_of_a_token_is_the_same_decoded_or_in_any_prefill_chunk(dtype):
    """One kernel for decodes and prefills, a fixed tile shape and key chunks
    from position 0: per query row the same arithmetic however it is batched.
    (bfloat16 in the interpreter: q, k, v widened to float32, triton_backend.py.)"""
    pytest.importorskip("triton")
    from executor_svc.attention.triton_backend import TritonAttentionBackend

    if torch.cuda.is_available():
        pytest.skip("the interpreter case; on a GPU the attention tests run the kernels themselves")
    backend = TritonAttentionBackend(block_q=4, block_n=16)
    seq_len = 21
    decoded = attend_in_steps(backend, [1] * seq_len, dtype, seq_len, head_dim=16)
    for chunks, others in (([seq_len], 0), ([6, 15], 1)):
        assert torch.equal(attend_in_steps(backend, chunks, dtype, seq_len, 16, others), decoded), chunks


def test_a_seeded_row_samples_the_same_alone_or_in_any_batch():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 5000, generator=gen) * 4
    logits[:, :50] = logits[:, 50:100]  # ties, at the top-k and top-p thresholds too
    params = [
        SEEDED,
        GREEDY,
        dataclasses.replace(SEEDED, seed=5, top_p=1.0),
        SEEDED,
        dataclasses.replace(SEEDED, top_k=0),
        GREEDY,
    ]
    sampler = Sampler()

    def sample(rows):
        md = build_sampling_metadata([params[r] for r in rows], [[1]] * len(rows), [[2] * r for r in rows], 5000, "cpu")
        out = sampler(logits[rows], md)
        return [(t, lp.logprob, lp.top) for t, lp in zip(out.sampled_token_ids.tolist(), out.logprobs)]

    batch = sample(list(range(6)))
    for r in range(6):
        assert sample([r]) == [batch[r]], r
    assert sample([3, 0]) == [batch[3], batch[0]]
