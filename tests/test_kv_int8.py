"""--kv-cache-dtype int8 (executor_svc/kv_quant.py): the quantization and its
error bound, the native write against the torch formula byte for byte, every
attention path over an int8 cache against the dense float64 reference over the
values the cache holds, and the executor end to end.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from attention_utils import mixed_shapes, run_step

from executor_svc import fused_ops, kv_quant
from executor_svc.attention import get_backend, native_kernel
from executor_svc.attention.cpu_backend import CpuAttentionBackend
from executor_svc.attention.reference import make_batch, quantized
from executor_svc.attention.torch_backend import TorchAttentionBackend
from executor_svc.config import ExecutorConfig
from executor_svc.native_build import cpu_flags
from executor_svc.worker import Worker

# Over the values the cache holds, the paths compute in float32, and the
# AVX-512 decode kernel also rounds each query to int16 (decode_int8.h): an
# error of up to 1/65534 of the query's largest |value| in each product.
INT8_TOLERANCE = dict(atol=2e-4, rtol=1e-3)


def backend(name: str):
    if name == "cpu":
        cpu = get_backend("cpu")
        assert cpu.name == "cpu", "the native kernels did not build (is a C compiler installed?)"
        return cpu
    if name == "portable":
        kernel = native_kernel.load(portable=True)
        assert kernel is not None, "the portable native kernel did not build"
        return CpuAttentionBackend(kernel)
    return TorchAttentionBackend()


def test_quantized_values_are_within_half_a_step_of_the_row_max():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 3, 64, generator=gen) * torch.rand(300, 3, 1, generator=gen) * 20
    rows = kv_quant.quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (300, 3, 64 + kv_quant.SCALE_BYTES)
    back = kv_quant.dequantize_rows(rows, torch.float64)
    step = x.abs().amax(-1, keepdim=True).double() / 127
    assert ((back - x.double()).abs() <= step / 2 * (1 + 1e-5)).all()
    # Each row's largest |value| is one of its levels: 127 x scale.
    assert rows[..., :64].abs().amax(-1).eq(127).all()


def test_fwht_is_the_normalized_hadamard_product_and_its_own_inverse():
    x = torch.randn(5, 3, 64, dtype=torch.float64)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 64:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    y = kv_quant.fwht(x)
    torch.testing.assert_close(y.double(), x @ h / 8, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv_quant.fwht(y).double(), x, atol=1e-5, rtol=1e-5)


def test_rotated_keys_spread_an_outlier_channel_and_cut_the_error():
    """Keys with one channel 30x the rest: one scale per row leaves the rest
    a few levels; stored rotated (keys=True) the error is several times smaller,
    and within the rotated row's half step in L2."""
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(500, 64, generator=gen)
    k[:, 9] *= 30
    plain = kv_quant.dequantize_rows(kv_quant.quantize_rows(k), torch.float64)
    rotated = kv_quant.dequantize_rows(kv_quant.quantize_rows(k, keys=True), torch.float64, keys=True)
    err_plain, err_rot = ((plain - k.double()).norm(dim=-1), (rotated - k.double()).norm(dim=-1))
    assert err_rot.mean() * 3 < err_plain.mean()
    half_step = kv_quant.fwht(k).abs().amax(-1).double() / 254
    assert (err_rot <= half_step * 8 * (1 + 1e-4) + 1e-5).all()  # sqrt(64) lanes of at most half a step


def test_a_zero_row_stays_zero_and_a_nan_poisons_its_row_only():
    x = torch.zeros(3, 64)
    x[1, 5] = float("nan")
    x[2] = torch.linspace(-1, 1, 64)
    back = kv_quant.dequantize_rows(kv_quant.quantize_rows(x))
    assert torch.equal(back[0], torch.zeros(64))
    assert back[1].isnan().all()
    assert back[2].isfinite().all()


# The native write needs the bf16 library's build, which needs AVX-512.
NATIVE_WRITE = fused_ops._LIBRARIES[torch.bfloat16]() is not None
needs_native_write = pytest.mark.skipif(not NATIVE_WRITE, reason="the native K/V write needs AVX-512")


@needs_native_write
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("dim", [64, 128, 40, 512])  # 512: the scalar quantizer, rotating
def test_native_write_stores_the_torch_formulas_bytes(src, dim):
    """fused_ops.write_kv (kv_write_int8) and kv_quant.quantize_rows write the
    same bytes, from strided views of a fused qkv row as the model hands them."""
    heads, q_heads, tokens = 3, 9, 12
    gen = torch.Generator().manual_seed(dim)
    fused = (torch.randn(tokens, q_heads + 2 * heads, dim, generator=gen) * 4).to(src)
    fused[4, q_heads] = 0  # a zero row: scale 0
    fused[6, q_heads + 1, 3] = float("nan")  # a NaN key: its row's scale NaN
    key, value = fused[:, q_heads : q_heads + heads], fused[:, q_heads + heads :]
    assert fused_ops.writes_kv(key, value, torch.empty(0, dtype=torch.int8), torch.empty(0, dtype=torch.int8))
    shape = (4, 8, heads, kv_quant.row_bytes(dim))
    k_cache, v_cache = torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8)
    slots = torch.tensor([3, 0, 31, 7, 8, 9, 20, 21, 22, 5, 14, 1])
    fused_ops.write_kv(key, value, k_cache, v_cache, slots)
    for cache, new, keys in ((k_cache, key, True), (v_cache, value, False)):
        want = torch.zeros(shape, dtype=torch.int8).view(-1, heads, shape[-1])
        want[slots] = kv_quant.quantize_rows(new, keys)
        got = cache.view(-1, heads, shape[-1])
        if keys:  # the NaN row: NaN scales need not share their bits
            nan_row = (slots[6], 1)
            assert kv_quant.dequantize_rows(got[nan_row], keys=True).isnan().all()
            got[nan_row], want[nan_row] = 0, 0
        assert torch.equal(got, want)


@needs_native_write
def test_native_write_refuses_a_slot_outside_the_cache_and_writes_nothing():
    key = torch.randn(2, 3, 64)
    k_cache, v_cache = (torch.zeros(2, 4, 3, 68, dtype=torch.int8) for _ in range(2))
    with pytest.raises(IndexError):
        fused_ops.write_kv(key, key, k_cache, v_cache, torch.tensor([1, 8]))
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize("name", ["cpu", "portable", "torch"])
@pytest.mark.parametrize(
    "block_size,group,head_dim", [(16, 3, 64), (8, 8, 128), (32, 1, 64), (16, 2, 128), (16, 2, 80)]
)
def test_attention_over_an_int8_cache_matches_the_reference(name, block_size, group, head_dim):
    """Decodes, fresh and chunked prefills, through the AVX-512 kernels, the
    portable C kernel and plain torch: exact attention over the cached values.
    head_dim 80 (keys not rotated: not a power of two) takes the portable
    decode and SDPA prefills on every backend."""
    batch = quantized(
        make_batch(
            mixed_shapes(block_size) + [(300, 1), (517, 1)],
            block_size=block_size,
            num_kv_heads=3,
            group=group,
            head_dim=head_dim,
            dtype=torch.float32,
            seed=block_size + group + head_dim,
        )
    )
    out = run_step(backend(name), batch)
    torch.testing.assert_close(out.double(), batch.expected(), **INT8_TOLERANCE)


def test_long_peaked_decodes_over_an_int8_cache_match_the_reference():
    """A sharp softmax over many chunks: the lazy running max must rescale right."""
    batch = quantized(
        make_batch(
            [(1000, 1), (517, 1), (33, 1), (15, 1)], block_size=16, num_kv_heads=3, group=3, head_dim=64, seed=41
        )
    )
    batch = dataclasses.replace(batch, query=batch.query * 6)
    out = run_step(backend("cpu"), batch)
    torch.testing.assert_close(out.double(), batch.expected(), **INT8_TOLERANCE)


@pytest.mark.skipif("avx512_vnni" not in cpu_flags(), reason="this CPU's build already lacks AVX512-VNNI")
def test_the_int8_decode_kernel_without_vnni_gives_the_same_bits():
    """decode_int8.h's key products through VPMADDWD + VPADDD (CPUs without
    AVX512-VNNI) instead of VPDPWSSD: integer arithmetic, so the same outputs."""
    from executor_svc.native_build import load_library

    lib = load_library(native_kernel.SOURCE, ("-mno-avx512vnni",))
    assert lib is not None, "the decode kernel did not build without VNNI"
    batch = quantized(
        make_batch([(300, 1), (45, 1), (16, 1)], block_size=16, num_kv_heads=3, group=3, head_dim=64, seed=4)
    )
    with_vnni = run_step(backend("cpu"), batch)
    without = run_step(CpuAttentionBackend(lib.paged_decode_attention), batch)
    assert torch.equal(with_vnni, without)
    torch.testing.assert_close(without.double(), batch.expected(), **INT8_TOLERANCE)


def test_int8_prefills_run_in_the_native_kernel(monkeypatch):
    """Prefills over an int8 cache go through paged_prefill.c, not SDPA."""
    cpu = backend("cpu")
    if cpu._prefill_kernel is None or "avx512f" not in cpu_flags():
        pytest.skip("the native prefill kernel needs AVX-512")

    def refuse(*args):
        raise AssertionError("an int8 prefill fell back to SDPA")

    monkeypatch.setattr(cpu, "_sdpa_prefills", refuse)
    batch = quantized(make_batch([(40, 30), (0, 17)], block_size=16, num_kv_heads=2, group=3, head_dim=64, seed=5))
    torch.testing.assert_close(run_step(cpu, batch).double(), batch.expected(), **INT8_TOLERANCE)


@pytest.mark.parametrize("name", ["cpu", "portable"])
def test_a_nan_query_head_gives_nan_for_that_head_only(name):
    batch = quantized(make_batch([(70, 1), (33, 1)], block_size=16, num_kv_heads=2, group=2, head_dim=64, seed=9))
    query = batch.query.clone()
    query[0, 1, 7] = float("nan")
    out = run_step(backend(name), dataclasses.replace(batch, query=query))
    assert out[0, 1].isnan().all()
    assert out[0, [0, 2, 3]].isfinite().all() and out[1].isfinite().all()


def test_the_executor_holds_188_percent_of_the_bf16_tokens_and_serves_from_them(english_prompts):
    """Same budget: int8 blocks are (64 + 4) / 128 of bf16 ones at head_dim 64."""
    from test_kv_cache_dtype import greedy
    from tokenizers import Tokenizer

    workers = [
        Worker(ExecutorConfig(dtype="bfloat16", kv_cache_dtype=kv, kv_cache_gib=0.05)) for kv in ("auto", "int8")
    ]
    infos = [w.configure(16, 256, 8) for w in workers]
    assert workers[1].runner.kv_caches[0][0].dtype == torch.int8
    assert 1.87 < infos[1].num_kv_blocks / infos[0].num_kv_blocks < 1.9  # 128 / 68, floors aside
    tok = Tokenizer.from_str(workers[0].tokenizer.tokenizer_json)
    prompt = tok.encode(english_prompts[2]).ids
    # The prefill's logits come from the prompt's own K/V read back from the cache.
    assert greedy(workers[1], prompt, 1) == greedy(workers[0], prompt, 1)


@pytest.mark.parametrize("chunk", [1, 24], ids=["decodes", "prefill-chunks"])
def test_int8_kv_keeps_the_embedded_models_next_token_choices(chunk):
    """Teacher-forced over real English (a stdlib docstring, as
    bench.bf16_quant_quality reads), one token a step (the decode kernel) or
    in chunks (the prefill kernel over cached chunks): the embedded model's
    next-token argmax over an int8 cache agrees with the bfloat16 cache's,
    and its top-5 logprobs stay close. On an AMD EPYC (Zen 5) the full bench
    measured 99.17% agreement and 0.025 mean |dlogp| (docs/benchmarks.md)."""
    from tokenizers import Tokenizer

    from bench.bf16_quant_quality import compare, logits_by_position, texts
    from executor_svc.model_loader import load_model

    loaded = load_model(None, torch.bfloat16, "cpu", get_backend("cpu"), packed_gemm=True, gguf_blocks=True)
    ids = Tokenizer.from_str(loaded.tokenizer.tokenizer_json).encode(texts()[0], add_special_tokens=False).ids[:96]
    got, want = (logits_by_position(loaded.model, ids, chunk, kv) for kv in (torch.int8, torch.bfloat16))
    r = compare(got, want)
    assert r["agree"] >= 0.9 and r["mean"] < 0.1, r


def test_a_row_too_small_to_invert_clamps_alike_in_torch_and_c():
    """127 / max|x| overflows float32 below ~3.7e-37: both writers clamp to +-127."""
    x = torch.zeros(1, 1, 64)
    x[0, 0, :3] = torch.tensor([1e-38, -1e-38, 5e-39])
    rows = kv_quant.quantize_rows(x)
    assert rows[0, 0, :3].tolist() == [127, -127, 127] and not rows[0, 0, 3:64].any()
    if NATIVE_WRITE:
        k_cache, v_cache = (torch.zeros(1, 1, 1, 68, dtype=torch.int8) for _ in range(2))
        fused_ops.write_kv(x, x, k_cache, v_cache, torch.tensor([0]))
        assert torch.equal(v_cache[0, 0], rows[0])


def test_the_triton_backend_refuses_an_int8_cache():
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        Worker(ExecutorConfig(kv_cache_dtype="int8", attention_backend="triton", device="cpu"))
