"""Our model against transformers, token for token, through the paged cache.

Every float32 case runs on the dense test backend and on the real torch
backend. The reference is transformers' greedy decoding with its own KV
cache, one prompt at a time; ours batches prompts, splits a prefill into two
chunks and reuses another request's cached prefix blocks, none of which may
change a token.
"""

from __future__ import annotations

import pytest
import torch
from model_utils import (
    PagedEngine,
    hf_greedy,
    load_hf_folder,
    make_backend,
    same_weights,
    save_tiny_hf_model,
)

from executor_svc import onednn_linear, packed_linear, weight_packing
from executor_svc.model_loader import load_model

BACKENDS = ["dense", "torch"]
NUM_NEW = 20
LOGPROB_TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def assert_top5_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    ours_top = torch.log_softmax(ours.float(), -1).topk(5)
    ref_top = torch.log_softmax(ref.float(), -1).topk(5)
    assert ours_top.indices.tolist() == ref_top.indices.tolist()
    assert torch.allclose(ours_top.values, ref_top.values, atol=LOGPROB_TOL, rtol=0), (
        f"top-5 logprobs: ours {ours_top.values.tolist()} vs HF {ref_top.values.tolist()}"
    )


def greedy_batched(engine: PagedEngine, prompts: list[list[int]], num_new: int):
    """All prompts prefilled in one forward, then batched decode steps.
    Returns (new tokens per prompt, first-position logits [n, vocab])."""
    seqs = [engine.add(p) for p in prompts]
    first = engine.step([(s, len(s.token_ids)) for s in seqs])
    for seq, token in zip(seqs, first.argmax(-1).tolist()):
        seq.token_ids.append(token)
    engine.decode(seqs, num_new - 1)
    return [s.token_ids[len(p) :] for s, p in zip(seqs, prompts)], first


def greedy_chunked_with_prefix_hit(engine: PagedEngine, a_prompt, b_prompt, c_suffix, num_new: int):
    """Three requests through mixed steps; returns the first num_new new tokens of each.

    step 1: A's first half            | B's whole prompt
    step 2: A's second half           | B decode
    step 3: A decode | B decode | C = A's full prompt blocks (prefix hit, not recomputed) + c_suffix
    then:   A, B, C decode together
    """
    bs = engine.block_size
    a, b = engine.add(a_prompt), engine.add(b_prompt)
    half = len(a_prompt) // 2
    logits = engine.step([(a, half), (b, len(b_prompt))])  # A is mid-prompt: nothing to sample
    b.token_ids.append(int(logits[1].argmax()))
    logits = engine.step([(a, len(a_prompt) - half), (b, 1)])
    for seq, token in zip((a, b), logits.argmax(-1).tolist()):
        seq.token_ids.append(token)

    shared_blocks = len(a_prompt) // bs
    assert shared_blocks >= 2, "prompt A too short to share blocks"
    c_prompt = a_prompt[: shared_blocks * bs] + c_suffix
    c = engine.add(c_prompt, prefix_from=a, num_prefix_blocks=shared_blocks)
    assert c.num_computed == shared_blocks * bs
    logits = engine.step([(a, 1), (b, 1), (c, len(c_prompt) - c.num_computed)])
    for seq, token in zip((a, b, c), logits.argmax(-1).tolist()):
        seq.token_ids.append(token)
    engine.decode([a, b, c], num_new - 1)
    outs = [s.token_ids[len(p) : len(p) + num_new] for s, p in ((a, a_prompt), (b, b_prompt), (c, c_prompt))]
    return outs, c_prompt


# --- SmolLM2 (the embedded GGUF) ---------------------------------------------


@pytest.fixture(scope="module")
def smol(hf_smollm2, english_prompts):
    """Our float32 SmolLM2, HF's, the prompts as ids, and HF's greedy answers."""
    hf_model, hf_tok = hf_smollm2
    ours = load_model(None, torch.float32, torch.device("cpu"), make_backend("dense")).model
    prompts = [hf_tok(english_prompts[i]).input_ids for i in (0, 2, 5)]
    assert len({len(p) for p in prompts}) == 3, "want prompts of different lengths"
    references = [hf_greedy(hf_model, p, NUM_NEW) for p in prompts]
    return ours, hf_model, prompts, references


def test_embedded_gguf_config(smol):
    config = smol[0].config
    assert (config.architecture, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.intermediate_size, config.rope_theta) == (49152, 1536, 100000.0)
    assert config.tie_word_embeddings and config.rope_scaling is None and not config.attention_bias
    assert (config.bos_token_id, config.eos_token_ids, config.max_position_embeddings) == (1, (2,), 8192)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_smollm2_batched_greedy_matches_hf(smol, backend):
    ours, _, prompts, references = smol
    engine = PagedEngine(same_weights(ours, make_backend(backend)), num_blocks=32, block_size=16)
    outs, first = greedy_batched(engine, prompts, NUM_NEW)
    for out, (ref, ref_first, _), row in zip(outs, references, first):
        assert out == ref
        assert_top5_close(row, ref_first)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_smollm2_chunked_prefill_and_prefix_hit_match_hf(smol, backend):
    ours, hf_model, prompts, references = smol
    engine = PagedEngine(same_weights(ours, make_backend(backend)), num_blocks=32, block_size=16)
    a_prompt, b_prompt = prompts[2], prompts[0]
    c_suffix = prompts[1][:12]
    num_new = 12
    outs, c_prompt = greedy_chunked_with_prefix_hit(engine, a_prompt, b_prompt, c_suffix, num_new)
    c_ref, _, _ = hf_greedy(hf_model, c_prompt, num_new)
    assert outs == [references[2][0][:num_new], references[0][0][:num_new], c_ref]


@pytest.mark.slow
@pytest.mark.skipif(packed_linear.kernel() is None, reason="needs x86 AVX-512 and a C compiler")
def test_smollm2_packed_gemm_matches_hf(smol):
    """The serving default on AVX-512 CPUs: linear layers through the packed kernel."""
    ours, _, prompts, references = smol
    model = same_weights(ours, make_backend("cpu"))
    weight_packing.pack_linear_weights(model)
    outs, first = greedy_batched(PagedEngine(model, num_blocks=32, block_size=16), prompts, NUM_NEW)
    for out, (ref, ref_first, _), row in zip(outs, references, first):
        assert out == ref
        assert_top5_close(row, ref_first)


@pytest.mark.slow
@pytest.mark.skipif(packed_linear.kernel() is None, reason="needs x86 AVX-512 and a C compiler")
def test_smollm2_gguf_blocks_match_hf(smol):
    """The serving default for the embedded GGUF: batches of up to 32 rows
    read the Q4_1 layers and the Q8_0 head in their blocks."""
    from executor_svc.gguf_loader import GGUFCheckpoint
    from executor_svc.model_loader import default_model_path

    ours, _, prompts, references = smol
    model = same_weights(ours, make_backend("cpu"))
    weight_packing.pack_linear_weights(model, GGUFCheckpoint(default_model_path()).blocks)
    assert model.layers[0].packed["down"].blocks.kind == "Q4_1" and model._head_packed.blocks.kind == "Q8_0"
    outs, first = greedy_batched(PagedEngine(model, num_blocks=32, block_size=16), prompts, NUM_NEW)
    for out, (ref, ref_first, _), row in zip(outs, references, first):
        assert out == ref
        assert_top5_close(row, ref_first)


# bf16 keeps 8 bits of mantissa: measured on the embedded model, teacher-forced
# logprobs of float32's top 5 differ from float32's by up to 0.26 nats (Xeon,
# torch's emulated bf16), and by up to 0.13 through NATIVE_BF16_ROUTES below
# (their kernels emulated on the same Xeon; one pick flipped at a near tie).
# Greedy tokens can then only be promised where float32's own top-1 lead is
# larger than that error; at a nearer tie (one of these prompts has a 0.096-nat
# lead at its second token) either pick is right, and CPUs with native bf16
# arithmetic round differently from emulated ones.
BF16_LOGPROB_TOL = 0.5


def teacher_forced_logits(model, sequence: list[int], num_positions: int) -> torch.Tensor:
    """float32 logits [num_positions, vocab] predicting each of the last
    num_positions tokens of `sequence`, computed one position per step."""
    engine = PagedEngine(model, num_blocks=32, block_size=16)
    seq = engine.add(sequence)
    prefix = len(sequence) - num_positions
    rows = [engine.step([(seq, prefix)])[0]]
    rows += [engine.step([(seq, 1)])[0] for _ in range(num_positions - 1)]
    return torch.stack(rows).float()


# The bf16 GEMM routes of a CPU with native bf16 (bf16_gemm_routes.py): decode
# rows through the VDPBF16PS kernel (emulated bit for bit where the CPU lacks
# it), prefill rows through oneDNN's bf16 GEMM; both round the activations to
# bf16. Forced here so that every CPU tests the path `--dtype auto` serves there.
NATIVE_BF16_ROUTES = ((1, "dot"), (8, "onednn"))
BF16_NUM_NEW = 8


@pytest.fixture(scope="module")
def f32_paths(smol):
    """float32's greedy continuation of each prompt and its teacher-forced logprobs along it."""
    ours, _, prompts, _ = smol
    f32_model = same_weights(ours, make_backend("torch"), torch.float32)
    f32_outs, _ = greedy_batched(PagedEngine(f32_model, num_blocks=32, block_size=16), prompts, BF16_NUM_NEW)
    return [
        (prompt + out, torch.log_softmax(teacher_forced_logits(f32_model, prompt + out, BF16_NUM_NEW), -1))
        for prompt, out in zip(prompts, f32_outs)
    ]


def bf16_model(ours, path: str):
    """A bf16 model over `ours`'s weights: with path "torch", torch's bf16 arithmetic (CUDA's
    path, --cpu-gemm torch); with "routed", the widened model with NATIVE_BF16_ROUTES, as
    `--dtype auto` serves it on CPUs with native bf16."""
    if path == "torch":
        return same_weights(ours, make_backend("torch"), torch.bfloat16)
    if packed_linear.kernel() is None:
        pytest.skip("needs x86 AVX-512 and a C compiler")
    model = same_weights(ours, make_backend("cpu"), torch.bfloat16)
    weight_packing.widen_bf16(model, lambda kind: NATIVE_BF16_ROUTES)
    packed = model.layers[0].packed["gate_up"]
    assert packed_linear.route(1, packed) == "dot"
    assert packed_linear.route(8, packed) == ("onednn" if onednn_linear.available() else "blocks")
    return model


@pytest.mark.slow
@pytest.mark.parametrize("path", ["torch", "routed"])
def test_smollm2_bfloat16_agrees_with_float32_up_to_rounding(smol, f32_paths, path):
    """bf16 runs, and along float32's own greedy path its next-token logprobs stay
    within bf16 rounding of float32's; its pick differs only at a near tie. Exact
    tokens are not promised: a CPU with native bf16 rounds otherwise than one that
    emulates it, and its routes round the activations too."""
    ours, _, prompts, _ = smol
    model = bf16_model(ours, path)
    assert model.embed_tokens.dtype == torch.bfloat16
    bf16_outs, bf16_first = greedy_batched(PagedEngine(model, num_blocks=32, block_size=16), prompts, BF16_NUM_NEW)
    assert bf16_first.dtype == torch.float32 and torch.isfinite(bf16_first).all()
    assert all(len(out) == BF16_NUM_NEW for out in bf16_outs)

    for seq, ref in f32_paths:
        got = torch.log_softmax(teacher_forced_logits(model, seq, BF16_NUM_NEW), -1)
        for pos, (ref_row, got_row) in enumerate(zip(ref, got)):
            top5 = ref_row.topk(5).indices
            err = (ref_row[top5] - got_row[top5]).abs().max().item()
            assert err < BF16_LOGPROB_TOL, f"position {pos}: bf16 top-5 logprob error {err:.3f}"
            ours_pick, ref_pick = int(got_row.argmax()), int(ref_row.argmax())
            assert ref_pick == seq[len(seq) - BF16_NUM_NEW + pos]
            lead = (ref_row[ref_pick] - ref_row[ours_pick]).item()
            assert lead < BF16_LOGPROB_TOL, (
                f"position {pos}: bf16 picks {ours_pick}, {lead:.3f} nats behind float32's {ref_pick}: "
                "more than bf16 rounding explains"
            )


# --- tiny random models of each architecture -----------------------------------

TINY_KINDS = ["llama3", "qwen2", "mistral", "llama_tied", "llama_linear"]


def _random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """kind -> (HF model, folder), built once per module."""
    built = {}

    def get(kind: str):
        if kind not in built:
            folder = str(tmp_path_factory.mktemp(kind))
            built[kind] = (save_tiny_hf_model(kind, folder), folder)
        return built[kind]

    return get


def assert_tiny_batch_matches_hf(ours, hf_model, num_new: int, seed: int) -> None:
    """Three random prompts of different lengths in one batch: greedy tokens
    equal HF's and the first step's top-5 logprobs agree."""
    prompts = _random_prompts(ours.config.vocab_size, [5, 11, 23], seed=seed)
    outs, first = greedy_batched(PagedEngine(ours, num_blocks=40, block_size=4), prompts, num_new)
    for prompt, out, row in zip(prompts, outs, first):
        ref, ref_first, _ = hf_greedy(hf_model, prompt, num_new)
        assert out == ref
        assert_top5_close(row, ref_first)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tiny_model_greedy_matches_hf(tiny, kind, backend):
    hf_model, folder = tiny(kind)
    ours = load_hf_folder(folder, make_backend(backend))
    num_new = 12
    assert_tiny_batch_matches_hf(ours, hf_model, num_new, seed=1)

    a, b, c_suffix = _random_prompts(ours.config.vocab_size, [14, 6, 5], seed=2)
    engine = PagedEngine(same_weights(ours, make_backend(backend)), num_blocks=40, block_size=4)
    outs, c_prompt = greedy_chunked_with_prefix_hit(engine, a, b, c_suffix, num_new)
    assert outs == [hf_greedy(hf_model, p, num_new)[0] for p in (a, b, c_prompt)]


@pytest.mark.skipif(packed_linear.kernel() is None, reason="needs x86 AVX-512 and a C compiler")
@pytest.mark.parametrize("kind", ["llama3", "qwen2", "llama_tied"])
def test_tiny_model_packed_gemm_matches_hf(tiny, kind):
    """Packed linear layers: untied head, qkv bias, tied head."""
    hf_model, folder = tiny(kind)
    ours = load_hf_folder(folder, make_backend("cpu"))
    weight_packing.pack_linear_weights(ours)
    assert_tiny_batch_matches_hf(ours, hf_model, 12, seed=3)
