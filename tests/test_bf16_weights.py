"""--dtype bfloat16 on CPUs without AVX512-BF16: bfloat16 weights (and KV),
float32 arithmetic (packed_linear.pack_bf16, LlamaForCausalLM.widen_bf16).

The claim to hold it to: the kernel widens each bfloat16 weight exactly and
keeps the float32 kernel's order of FMAs, so a widened model computes what a
float32 model holding the same (bfloat16-valued) weights computes, bit for
bit, wherever both run the packed kernel."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executor_svc import packed_linear
from executor_svc.hf_loader import HFCheckpoint
from executor_svc.model import LlamaForCausalLM
from executor_svc.packed_linear import BLOCK_FORMATS, PACKED_MAX_ROWS, PackedWeight, linear, pack, pack_bf16, route
from model_utils import PagedEngine, make_backend, save_tiny_hf_model

pytestmark = pytest.mark.skipif(packed_linear.kernel() is None, reason="needs x86 AVX-512 and a C compiler")


def bf16_weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def float32_panels(x, weight, bias):
    """The float32 panel kernel at any row count (linear() sends 1 row and > 256 rows to MKL)."""
    n, k = weight.shape
    out, panels = torch.empty(x.shape[0], n), pack(weight)  # held until the call returns
    assert packed_linear.kernel().gemm(out.data_ptr(), n, x.data_ptr(), k, panels.data_ptr(),
                                       None if bias is None else bias.data_ptr(), x.shape[0], n, k, 2) == 0
    return out


@pytest.mark.parametrize("shape", [(5, 32), (50, 64), (960, 576), (100, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 33, 100, PACKED_MAX_ROWS])
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
    weight, x = bf16_weight(70, 64, seed=1), torch.randn(PACKED_MAX_ROWS + 1, 64)
    packed = PackedWeight(None, pack_bf16(weight))
    assert route(x.shape[0], packed) == "torch"
    assert torch.equal(linear(x, weight, None, packed), F.linear(x, weight.float()))
    assert linear(x[:0], weight, None, packed).shape == (0, 70)


def test_bf16_kernel_writes_exactly_its_outputs_over_several_chunks():
    """Called directly: 600 rows are three row chunks; C has a wider row
    stride than N, poisoned, and only the [M, N] part may be written."""
    n, k, m, ldc = 53, 96, 600, 61
    weight = bf16_weight(n, k, seed=3)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4))
    out = torch.full((m, ldc), float("nan"))
    blocks = pack_bf16(weight)
    assert packed_linear.kernel().gemm_blocks(out.data_ptr(), ldc, x.data_ptr(), k, blocks.data.data_ptr(),
                                              BLOCK_FORMATS["BF16"][0], None, m, n, k, 2) == 0
    assert torch.equal(out[:, :n], float32_panels(x, weight.float(), None))
    assert out[:, n:].isnan().all()


def test_bf16_panel_layout_and_input_checks():
    """One block of one panel: 32 k rows of the 48 columns' bfloat16 weights."""
    weight = bf16_weight(50, 64, seed=0)
    blocks = pack_bf16(weight)
    width = packed_linear.kernel().panel_width
    assert blocks.data.shape == (2, 2, 2 * 32 * width) and blocks.kind == "BF16"
    cell = blocks.data[1, 1].view(torch.bfloat16).view(32, width)  # panel 1, k 32..63
    assert torch.equal(cell[:, :2], weight[48:50, 32:64].t())
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
        model.widen_bf16()
    else:
        model = LlamaForCausalLM(checkpoint.config, make_backend("cpu"))
        model.load_weights(lambda name: checkpoint.tensor(name).to(torch.bfloat16).float())
        model.pack_linear_weights()
    return model


def run(model, kv_dtype: torch.dtype) -> tuple[torch.Tensor, list[list[int]]]:
    """A 12-token prefill of two prompts, then five greedy decode steps of both:
    every GEMM has 2..256 rows. Returns the stacked logits and the tokens."""
    engine = PagedEngine(model, num_blocks=32, block_size=16, kv_dtype=kv_dtype)
    seqs = [engine.add([3, 141, 59, 26, 53, 58, 97, 93, 23]), engine.add([5, 6, 7])]
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
    assert all(p.panels is None and p.blocks.kind == "BF16" for layer in widened.layers for p in layer.packed.values())
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
    model.widen_bf16()
    layer = model.layers[1]
    assert "down" not in layer.packed and layer.down_weight.dtype == torch.float32
    x = torch.randn(3, layer.down_weight.shape[1])
    assert torch.equal(linear(x, layer.down_weight, None, layer.packed.get("down")), F.linear(x, layer.down_weight))
    for name in ("qkv", "o", "gate_up"):
        weight = getattr(layer, f"{name}_weight")
        eye = torch.eye(weight.shape[1])
        assert torch.equal(linear(eye, weight, None, layer.packed[name]), weight.t().float())
