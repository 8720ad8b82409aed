"""--dtype bfloat16 on CPUs without AVX512-BF16: bfloat16 weights (and KV),
float32 arithmetic (packed_linear.pack_bf16, weight_packing.widen_bf16).

The claim to hold it to: the kernel widens each bfloat16 weight exactly and
keeps the float32 kernel's order of FMAs, so a widened model computes what a
float32 model holding the same (bfloat16-valued) weights computes, bit for
bit, wherever both run the packed kernel."""

from __future__ import annotations

import pytest
import torch
from model_utils import PagedEngine, make_backend, save_tiny_gguf, save_tiny_hf_model
from test_packed_linear import float32_panels, quantized

from executor_svc import packed_linear, weight_packing
from executor_svc.config import ExecutorConfig
from executor_svc.gguf_loader import GGUFCheckpoint
from executor_svc.hf_loader import HFCheckpoint
from executor_svc.model import LINEAR_PARTS, LlamaForCausalLM
from executor_svc.model_loader import load_model
from executor_svc.packed_linear import (
    BF16_MAX_ROWS,
    BLOCK_FORMATS,
    BLOCKS_MAX_ROWS,
    PACKED_MAX_ROWS,
    PackedWeight,
    linear,
    pack_bf16,
    pack_blocks,
    route,
)

pytestmark = pytest.mark.skipif(packed_linear.kernel() is None, reason="needs x86 AVX-512 and a C compiler")


def bf16_weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("shape", [(5, 32), (50, 64), (960, 576), (100, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 33, 100, PACKED_MAX_ROWS, BF16_MAX_ROWS])
def test_bf16_panels_give_the_float32_result_bit_for_bit(shape, rows):
    n, k = shape
    weight = bf16_weight(n, k, seed=rows + n)
    gen = torch.Generator().manual_seed(n * rows)
    x, bias = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    packed = PackedWeight(None, pack_bf16(weight))
    assert route(rows, packed) == "blocks"
    for b in (None, bias):
        got = linear(x, weight, b, packed)
        assert torch.equal(got, float32_panels(x, weight.float(), b))
        want = x.double() @ weight.double().t() + (0 if b is None else b.double())
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5 * k**0.5 * 4)


def test_bf16_weights_past_the_kernel_range_go_to_mkl_widened():
    """The model's weights are column-major views ([in, out] storage); past
    BF16_MAX_ROWS rows MKL multiplies the widened weight, whose values are exact."""
    weight = bf16_weight(64, 70, seed=1).t()  # [70, 64] stored [64, 70], like model._empty_linear
    x = torch.randn(BF16_MAX_ROWS + 1, 64, generator=torch.Generator().manual_seed(2))
    packed = PackedWeight(None, pack_bf16(weight))
    assert route(x.shape[0], packed) == "torch"
    got = linear(x, weight, None, packed)
    assert got.dtype == torch.float32 and got.shape == (BF16_MAX_ROWS + 1, 70)
    torch.testing.assert_close(got.double(), x.double() @ weight.double().t(), rtol=0, atol=2e-5 * 64**0.5 * 4)


def test_zero_rows_through_bf16_panels():
    weight = bf16_weight(70, 64, seed=1)
    packed = PackedWeight(None, pack_bf16(weight))
    assert route(0, packed) == "blocks"
    assert linear(torch.empty(0, 64), weight, None, packed).shape == (0, 70)


def test_bf16_kernel_writes_exactly_its_outputs_over_several_chunks():
    """Called directly: 600 rows are three row chunks; C has a wider row
    stride than N, poisoned, and only the [M, N] part may be written."""
    n, k, m, ldc = 53, 96, 600, 61
    weight = bf16_weight(n, k, seed=3)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4))
    out = torch.full((m, ldc), float("nan"))
    blocks = pack_bf16(weight)
    assert (
        packed_linear.kernel().gemm_blocks(
            out.data_ptr(), ldc, x.data_ptr(), k, blocks.data.data_ptr(), BLOCK_FORMATS["BF16"][0], None, m, n, k, 2
        )
        == 0
    )
    assert torch.equal(out[:, :n], float32_panels(x, weight.float(), None))
    assert out[:, n:].isnan().all()


def test_bf16_panel_layout_and_input_checks():
    """One block of one panel: 16 pairs of k, each the 48 columns' two
    bfloat16 weights side by side (the dot kernel's operand order)."""
    weight = bf16_weight(50, 64, seed=0)
    blocks = pack_bf16(weight)
    width = packed_linear.kernel().panel_width
    assert blocks.data.shape == (2, 2, 2 * 32 * width) and blocks.kind == "BF16"
    cell = blocks.data[1, 1].view(torch.bfloat16).view(16, width, 2)  # panel 1, k 32..63
    # cell[s, c, i] = weight[48 + c, 32 + 2s + i]
    assert torch.equal(cell[:, :2, :], weight[48:50, 32:64].reshape(2, 16, 2).transpose(0, 1))
    assert (cell[:, 2:].float() == 0).all()
    with pytest.raises(AssertionError, match="bfloat16 CPU weights"):
        pack_bf16(weight.float())
    with pytest.raises(AssertionError, match="not a multiple of 32"):
        pack_bf16(bf16_weight(8, 40, seed=0))


def load(folder: str, widened: bool) -> LlamaForCausalLM:
    """The checkpoint's weights rounded to bfloat16: widened (bfloat16 model,
    float32 arithmetic) or as a float32 model with float32 panels."""
    checkpoint = HFCheckpoint(folder)
    if widened:
        model = LlamaForCausalLM(checkpoint.config, make_backend("cpu"), dtype=torch.bfloat16)
        model.load_weights(checkpoint.tensor)
        weight_packing.widen_bf16(model)
    else:
        model = LlamaForCausalLM(checkpoint.config, make_backend("cpu"))
        model.load_weights(lambda name: checkpoint.tensor(name).to(torch.bfloat16).float())
        weight_packing.pack_linear_weights(model)
    return model


def run(model, kv_dtype: torch.dtype, prompts=([3, 141, 59, 26, 53, 58, 97, 93, 23], [5, 6, 7])):
    """One prefill step of all prompts, then five greedy decode steps of all
    of them. Returns the stacked logits and the tokens."""
    engine = PagedEngine(model, num_blocks=48, block_size=16, kv_dtype=kv_dtype)
    seqs = [engine.add(list(p)) for p in prompts]
    work, steps = [(s, len(s.token_ids)) for s in seqs], []
    for _ in range(6):
        steps.append(engine.step(work))
        for seq, token in zip(seqs, steps[-1].argmax(-1).tolist()):
            seq.token_ids.append(token)
        work = [(s, 1) for s in seqs]
    return torch.stack(steps), [s.token_ids for s in seqs]


@pytest.mark.parametrize("kind", ["llama_tied", "qwen2"])
def test_widened_bf16_model_is_the_float32_model_of_its_weights(tmp_path, kind):
    """Same logits in every bit as a float32 model holding the bfloat16-rounded
    weights (both with a float32 KV cache); with the bfloat16 KV cache it is
    served with, the same greedy tokens and logits within bf16's rounding."""
    save_tiny_hf_model(kind, str(tmp_path))
    widened, plain = load(str(tmp_path), widened=True), load(str(tmp_path), widened=False)
    assert widened.compute_dtype == torch.float32 and widened.embed_tokens.dtype == torch.bfloat16
    for layer in widened.layers:
        assert set(layer.packed) == set(LINEAR_PARTS)
        assert all(p.panels is None and p.blocks.kind == "BF16" for p in layer.packed.values())
    assert widened._head_packed.blocks.kind == "BF16" and widened._tied_head is None  # no float32 head copy
    assert widened.layers[0].qkv_weight.dtype == torch.bfloat16
    assert all(t.dtype == torch.float32 for t in (widened.norm, widened.layers[0].input_norm, widened.rope_cos))
    if kind == "qwen2":
        assert widened.layers[0].qkv_bias.dtype == torch.float32
    logits, tokens = run(widened, torch.float32)
    want_logits, want_tokens = run(plain, torch.float32)
    assert torch.equal(logits, want_logits) and tokens == want_tokens
    served_logits, served_tokens = run(widened, torch.bfloat16)
    assert served_tokens == want_tokens
    torch.testing.assert_close(served_logits, want_logits, rtol=0, atol=0.05 * want_logits.abs().max().item())


def test_tensor_parallel_shard_that_splits_a_block_widens_to_float32(tmp_path):
    """Rank 1 of 2: down's 80 input columns are not a multiple of 32, so it
    becomes a float32 tensor for MKL; the other weights are bfloat16 panels
    that read back exactly."""
    save_tiny_hf_model("llama_tied", str(tmp_path))
    checkpoint = HFCheckpoint(str(tmp_path))
    model = LlamaForCausalLM(checkpoint.config, make_backend("dense"), dtype=torch.bfloat16, tp_rank=1, tp_size=2)
    model.load_weights(checkpoint.tensor)
    weight_packing.widen_bf16(model)
    layer = model.layers[1]
    assert "down" not in layer.packed and layer.down_weight.dtype == torch.float32
    down = checkpoint.tensor("model.layers.1.mlp.down_proj.weight")  # [64, 160]; rank 1 holds columns 80..159
    assert torch.equal(layer.down_weight, down[:, 80:].to(torch.bfloat16).float())
    for name in ("qkv", "o", "gate_up"):
        weight = getattr(layer, f"{name}_weight")
        eye = torch.eye(weight.shape[1])
        assert torch.equal(linear(eye, weight, None, layer.packed[name]), weight.t().float())


def test_long_prefill_and_single_decodes(tmp_path):
    """A 520-token prompt (GEMMs past 512 rows: MKL on the widened weights,
    as the float32 model's MKL on the same values) ends in the float32
    model's hidden state bit for bit; the logits of its one-row decodes (the
    block kernel against MKL's differently ordered sums, head included)
    agree within float32 rounding, with the same tokens."""
    save_tiny_hf_model("qwen2", str(tmp_path), max_position_embeddings=640)
    widened, plain = load(str(tmp_path), widened=True), load(str(tmp_path), widened=False)
    prompt = [(7 * i + 3) % 320 for i in range(520)]
    hidden = []
    for model in (widened, plain):
        model.compute_logits = lambda h: h.clone()  # the final hidden state, not the head's 1-row GEMM
        hidden.append(run(model, torch.float32, prompts=[prompt])[0][0])
        del model.compute_logits
    assert torch.equal(hidden[0], hidden[1])
    logits, tokens = run(widened, torch.float32, prompts=[prompt])
    want_logits, want_tokens = run(plain, torch.float32, prompts=[prompt])
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-4 * want_logits.abs().max().item())


def test_widths_that_are_not_multiples_of_32_widen_to_float32(tmp_path):
    """hidden_size 48: every weight reading the hidden state (qkv, gate_up,
    o, whose input is 4 heads x 12) and the tied head become float32 tensors
    for MKL; down (input 160) keeps its bfloat16 panels."""
    save_tiny_hf_model("llama_tied", str(tmp_path), hidden_size=48)
    widened, plain = load(str(tmp_path), widened=True), load(str(tmp_path), widened=False)
    assert all(set(layer.packed) == {"down"} for layer in widened.layers)
    assert widened.layers[0].qkv_weight.dtype == torch.float32 and widened._head_packed is None
    assert widened._tied_head.dtype == torch.float32
    logits, tokens = run(widened, torch.float32)
    want_logits, want_tokens = run(plain, torch.float32)
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-4 * want_logits.abs().max().item())


def test_worker_serves_bfloat16_widened(tmp_path):
    """Through the executor's Worker: --dtype bfloat16 on a CPU without fast
    bf16 (forced here, whatever this CPU has) loads the widened model and a
    bfloat16 KV cache; --cpu-gemm torch keeps torch's bf16."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from executor_svc import machine
    from executor_svc.worker import Worker

    save_tiny_hf_model("llama_tied", str(tmp_path))
    # The Worker loads a tokenizer with every model; nothing here tokenizes.
    Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    original = machine.cpu_has_fast_bf16
    machine.cpu_has_fast_bf16 = lambda: False
    try:
        widened = Worker(ExecutorConfig(model=str(tmp_path), dtype="bfloat16", kv_cache_gib=0.01))
        emulated = Worker(ExecutorConfig(model=str(tmp_path), dtype="bfloat16", kv_cache_gib=0.01, cpu_gemm="torch"))
    finally:
        machine.cpu_has_fast_bf16 = original
    assert widened.packed_gemm and widened.model.compute_dtype == torch.float32
    assert weight_packing.block_panel_bytes(widened.model) > 0
    assert not emulated.packed_gemm and emulated.model.compute_dtype == torch.bfloat16
    info = widened.configure(block_size=16, max_num_batched_tokens=64, max_num_seqs=4)
    assert info.dtype_name == "bfloat16" and widened.runner.kv_caches[0][0].dtype == torch.bfloat16


# --- GGUF blocks beside the bfloat16 ones (--gguf-blocks auto) -------------------------


def test_gguf_blocks_take_small_batches_of_a_bfloat16_weight():
    """1..BLOCKS_MAX_ROWS rows read the file's blocks, more rows the BF16
    blocks (then MKL); zero rows stay on the BF16 blocks. Measured routes
    replace that rule: the file's blocks only where they say so."""
    weight, raw = quantized("Q8_0", 48, 64, seed=5)
    bf16 = weight.to(torch.bfloat16)
    plain = PackedWeight(None, pack_bf16(bf16))
    both = PackedWeight(None, pack_bf16(bf16), gguf=pack_blocks("Q8_0", raw))
    rows = (0, 1, BLOCKS_MAX_ROWS, BLOCKS_MAX_ROWS + 1, BF16_MAX_ROWS, BF16_MAX_ROWS + 1)
    assert [route(r, both) for r in rows] == ["blocks", "gguf", "gguf", "blocks", "blocks", "torch"]
    assert [route(r, plain) for r in rows] == ["blocks", "blocks", "blocks", "blocks", "blocks", "torch"]
    routes = ((1, "gguf"), (16, "onednn"), (300, "dot"))
    hybrid = PackedWeight(None, pack_bf16(bf16), torch.empty(0), pack_blocks("Q8_0", raw), bf16_routes=routes)
    rows = (0, 1, 15, 16, BLOCKS_MAX_ROWS, 299, 300, BF16_MAX_ROWS + 1)
    assert [route(r, hybrid) for r in rows] == ["blocks", "gguf", "gguf", "onednn", "onednn", "onednn", "dot", "dot"]
    # A weight without file blocks or a oneDNN copy reads its BF16 blocks there.
    bare = PackedWeight(None, pack_bf16(bf16), bf16_routes=routes)
    assert [route(r, bare) for r in (1, 16, 300, BF16_MAX_ROWS + 1)] == ["blocks", "blocks", "dot", "dot"]
    back = PackedWeight(None, pack_bf16(bf16), bf16_routes=((1, "dot"), (64, "blocks")))
    assert [route(r, back) for r in (63, 64, BF16_MAX_ROWS + 1)] == ["dot", "blocks", "torch"]
    with pytest.raises(AssertionError, match="for bfloat16 weights"):
        PackedWeight(packed_linear.pack(weight), pack_blocks("Q8_0", raw), gguf=pack_blocks("Q8_0", raw))


def gguf_models(tmp_path, kind: str, quant: str):
    """(bfloat16 widened model with the file's blocks, float32 model with
    them, the checkpoint) from one quantized GGUF."""
    hf_model = save_tiny_hf_model(kind, str(tmp_path))
    save_tiny_gguf(hf_model, str(tmp_path / "tiny.gguf"), quantize=quant)
    checkpoint = GGUFCheckpoint(str(tmp_path / "tiny.gguf"))
    widened = LlamaForCausalLM(checkpoint.config, make_backend("cpu"), dtype=torch.bfloat16)
    widened.load_weights(checkpoint.tensor)
    weight_packing.apply(widened, checkpoint.blocks)
    plain = LlamaForCausalLM(checkpoint.config, make_backend("cpu"))
    plain.load_weights(checkpoint.tensor)
    weight_packing.apply(plain, checkpoint.blocks)
    return widened, plain, checkpoint


@pytest.mark.parametrize("quant", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("kind", ["llama_tied", "qwen2"])
def test_bf16_gguf_blocks_give_the_float32_models_block_outputs(tmp_path, kind, quant):
    """Every linear and the head of a widened bfloat16 model from a quantized
    GGUF: up to BLOCKS_MAX_ROWS rows, the same outputs in every bit as the
    float32 model's block path on the same inputs (both multiply the file's
    exact values in float32, in one order of FMAs), though the bfloat16
    weights hold those values rounded; past it, the BF16 blocks' outputs."""
    widened, plain, _ = gguf_models(tmp_path, kind, quant)
    pairs = [
        (
            w.packed[n],
            p.packed[n],
            getattr(w, f"{n}_weight"),
            getattr(p, f"{n}_weight"),
            p.qkv_bias if n == "qkv" else None,
        )
        for w, p in zip(widened.layers, plain.layers)
        for n in LINEAR_PARTS
    ]
    head = plain.embed_tokens if plain.lm_head is None else plain.lm_head
    pairs.append((widened._head_packed, plain._head_packed, None, head, None))
    assert all(w.gguf is not None and w.gguf.kind == quant for w, *_ in pairs)
    assert any(
        not torch.equal(w_weight.float(), p_weight) for _, _, w_weight, p_weight, _ in pairs if w_weight is not None
    )
    gen = torch.Generator().manual_seed(0)
    for w_packed, p_packed, w_weight, p_weight, bias in pairs:
        w_weight = p_weight.to(torch.bfloat16) if w_weight is None else w_weight
        for rows in (1, 3, BLOCKS_MAX_ROWS):
            x = torch.randn(rows, p_weight.shape[1], generator=gen)
            assert route(rows, w_packed) == "gguf" and route(rows, p_packed) == "blocks"
            assert torch.equal(linear(x, w_weight, bias, w_packed), linear(x, p_weight, bias, p_packed))
        x = torch.randn(BLOCKS_MAX_ROWS + 1, p_weight.shape[1], generator=gen)
        assert route(x.shape[0], w_packed) == "blocks"
        want = linear(x, w_weight, bias, PackedWeight(None, pack_bf16(w_weight)))
        assert torch.equal(linear(x, w_weight, bias, w_packed), want)


def test_bf16_gguf_blocks_through_the_loader_and_the_flag(tmp_path):
    """load_model with gguf_blocks (what --gguf-blocks auto passes) keeps the
    file's blocks beside the BF16 ones and counts their bytes; without it
    (off) only the BF16 blocks, as before. Both models greedily decode the
    same first tokens from a prompt (the file's values against their bf16
    rounding: a tiny random model, no near ties on this prompt)."""
    hf_model = save_tiny_hf_model("llama_tied", str(tmp_path))
    save_tiny_gguf(hf_model, str(tmp_path / "tiny.gguf"), quantize="Q4_1")
    models = {}
    for flag in (True, False):
        models[flag] = load_model(
            str(tmp_path / "tiny.gguf"),
            torch.bfloat16,
            "cpu",
            make_backend("cpu"),
            with_tokenizer=False,
            packed_gemm=True,
            gguf_blocks=flag,
        ).model
    on, off = models[True], models[False]
    for model in (on, off):
        assert model.compute_dtype == torch.float32
        assert all(p.blocks.kind == "BF16" for layer in model.layers for p in layer.packed.values())
    assert all(p.gguf.kind == "Q4_1" for layer in on.layers for p in layer.packed.values())
    assert on._head_packed.gguf.kind == "Q4_1"
    assert all(p.gguf is None for layer in off.layers for p in layer.packed.values()) and off._head_packed.gguf is None
    gguf_bytes = sum(p.gguf.nbytes for layer in on.layers for p in layer.packed.values()) + on._head_packed.gguf.nbytes
    assert weight_packing.block_panel_bytes(on) == weight_packing.block_panel_bytes(off) + gguf_bytes
    assert run(on, torch.bfloat16)[1] == run(off, torch.bfloat16)[1]


def test_bf16_gguf_blocks_hold_each_tensor_parallel_share(tmp_path):
    """Rank 1 of 2 of a widened model keeps the file's blocks of its share of
    q/k/v, gate/up and o, which read back (identity rows, <= 32 at a time)
    as the file's values of that share: the float32 model's shard weights.
    down's 80 input columns split a block: a float32 tensor, no blocks."""
    hf_model = save_tiny_hf_model("llama_tied", str(tmp_path))
    save_tiny_gguf(hf_model, str(tmp_path / "tiny.gguf"), quantize="Q8_0")
    checkpoint = GGUFCheckpoint(str(tmp_path / "tiny.gguf"))
    shards = []
    for dtype in (torch.bfloat16, torch.float32):
        model = LlamaForCausalLM(checkpoint.config, make_backend("dense"), dtype=dtype, tp_rank=1, tp_size=2)
        model.load_weights(checkpoint.tensor)
        shards.append(model)
    widened, plain = shards
    weight_packing.widen_bf16(widened, blocks=checkpoint.blocks)
    layer, want = widened.layers[1], plain.layers[1]
    assert "down" not in layer.packed and layer.down_weight.dtype == torch.float32
    for name in ("qkv", "o", "gate_up"):
        weight, exact = getattr(layer, f"{name}_weight"), getattr(want, f"{name}_weight")
        eye = torch.eye(weight.shape[1])
        for start in range(0, weight.shape[1], 7):
            rows = eye[start : start + 7]
            assert route(rows.shape[0], layer.packed[name]) == "gguf"
            assert torch.equal(linear(rows, weight, None, layer.packed[name]), exact[:, start : start + 7].t())


def test_each_kind_of_file_blocks_takes_the_routes_measured_for_it(tmp_path):
    """SmolLM2's file keeps its layers in Q4_1 and its head in Q8_0, whose
    loops win at other row counts: widen_bf16 asks for the routes of each
    kind a weight's blocks turn out to be (None: no blocks), once per weight,
    and gives each weight its own kind's."""
    hf_model = save_tiny_hf_model("llama_tied", str(tmp_path))
    for kind in ("Q4_1", "Q8_0"):
        save_tiny_gguf(hf_model, str(tmp_path / f"{kind}.gguf"), quantize=kind)
    q4, q8 = GGUFCheckpoint(str(tmp_path / "Q4_1.gguf")), GGUFCheckpoint(str(tmp_path / "Q8_0.gguf"))

    def mixed(name: str):  # the head in Q8_0, the layers in Q4_1, one layer's down projection in none
        if name == "model.layers.0.mlp.down_proj.weight":
            return None
        return (q8 if name == "model.embed_tokens.weight" else q4).blocks(name)

    routes = {"Q4_1": ((1, "gguf_dot"), (32, "dot")), "Q8_0": ((1, "gguf"), (5, "dot")), None: ((1, "dot"),)}
    asked = []
    model = load_model(
        str(tmp_path / "Q4_1.gguf"), torch.bfloat16, "cpu", make_backend("cpu"), with_tokenizer=False
    ).model
    weight_packing.widen_bf16(model, lambda kind: asked.append(kind) or routes[kind], blocks=mixed)
    head = model._head_packed
    assert head.gguf.kind == "Q8_0" and head.bf16_routes == routes["Q8_0"]
    assert [packed_linear.route(r, head) for r in (4, 5)] == ["gguf", "dot"]
    layer0, layer1 = (model.layers[i].packed for i in (0, 1))
    assert layer0["down"].gguf is None and layer0["down"].bf16_routes == routes[None]
    assert layer0["gate_up"].gguf.kind == "Q4_1" and layer0["gate_up"].bf16_routes == routes["Q4_1"]
    assert all(p.bf16_routes == routes["Q4_1"] for p in layer1.values())
    assert packed_linear.route(4, layer1["qkv"]) == "gguf_dot"
    assert set(asked) == {"Q4_1", "Q8_0", None} and len(asked) == 1 + 4 * len(model.layers)
