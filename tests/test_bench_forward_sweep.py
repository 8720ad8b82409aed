"""bench.forward_sweep's accounting: the bytes a step reads per packed_linear
route (on real float32 and bfloat16 Workers of a tiny model, and on hand-made
packed weights for the routes only CPUs with bf16 arithmetic take), the
bf16 ceiling choice, and the context sweep's attention rate."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bench import forward_sweep, membw, step_bytes
from executor_svc import packed_linear
from executor_svc.config import ExecutorConfig
from executor_svc.worker import Worker

needs_kernel = pytest.mark.skipif(packed_linear.kernel() is None, reason="the packed GEMM kernel is not built here")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from tests.model_utils import save_tiny_hf_model

    folder = tmp_path_factory.mktemp("tiny")
    save_tiny_hf_model("llama_tied", str(folder))
    Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(folder / "tokenizer.json"))
    return str(folder)


def load(model_dir: str, dtype: str, **options) -> Worker:
    threads = torch.get_num_threads()
    try:
        return Worker(ExecutorConfig(model=model_dir, dtype=dtype, kv_cache_gib=0.001, num_threads=1, **options))
    finally:
        torch.set_num_threads(threads)  # the Worker sets them for the whole process


def shapes(model) -> list[tuple[int, int]]:
    """[out, in] of every linear weight and of the (tied) head."""
    layers = [getattr(layer, f"{n}_weight").shape for layer in model.layers for n in ("qkv", "o", "gate_up", "down")]
    return [tuple(s) for s in layers] + [tuple(model.embed_tokens.shape)]


def padded(out_features: int) -> int:
    width = packed_linear.kernel().panel_width
    return -(-out_features // width) * width


@needs_kernel
def test_float32_steps_read_mkl_weights_at_one_row_and_the_panels_from_two(tiny_model_dir):
    # --cpu-gemm native: the fixed row limits, which under auto a start-up
    # timing may raise on this CPU (float_gemm_rows.py).
    model = load(tiny_model_dir, "float32", cpu_gemm="native").model
    plain = sum(4 * o * i for o, i in shapes(model))
    panels = sum(4 * padded(o) * i for o, i in shapes(model))
    assert panels > plain  # the tiny model's widths are not whole panels: padding is read too
    assert step_bytes.weight_read_bytes(model, 1, 1) == {"torch": plain}
    assert step_bytes.weight_read_bytes(model, 2, 2) == {"panels": panels}
    # Past PACKED_MAX_ROWS the layers go to MKL; the head sees only the sampled rows.
    head = 4 * padded(model.embed_tokens.shape[0]) * model.embed_tokens.shape[1]
    assert step_bytes.weight_read_bytes(model, 300, 8) == {
        "torch": plain - 4 * model.embed_tokens.numel(),
        "panels": head,
    }


@needs_kernel
def test_bfloat16_steps_read_the_bf16_blocks_half_the_float32_panels(tiny_model_dir):
    # --cpu-gemm native: no start-up timing of bf16 GEMM routes, which CPUs
    # with AVX512-BF16 or AMX would run under auto (their bytes: the next test).
    worker = load(tiny_model_dir, "bfloat16", cpu_gemm="native")
    model = worker.model
    assert model.compute_dtype == torch.float32 and not any(p.bf16_routes for p in model.layers[0].packed.values())
    blocks = sum(2 * padded(o) * i for o, i in shapes(model))
    for rows in (1, 64, packed_linear.BF16_MAX_ROWS):
        assert step_bytes.weight_read_bytes(model, rows, 1) == {"blocks": blocks}
    # Past BF16_MAX_ROWS MKL reads the bfloat16 tensors (widened per call).
    head = 2 * padded(model.embed_tokens.shape[0]) * model.embed_tokens.shape[1]
    plain = sum(2 * o * i for o, i in shapes(model)) - 2 * model.embed_tokens.numel()
    assert step_bytes.weight_read_bytes(model, 600, 1) == {"torch": plain, "blocks": head}
    cfg = worker.model_config
    assert step_bytes.kv_read_bytes(cfg, worker.kv_dtype, 3, 40) == (
        3 * 40 * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    )


@needs_kernel
def test_routes_of_cpus_with_bf16_count_their_own_copies():
    """gguf reads the file's blocks, dot the BF16 blocks, onednn as many bytes as the bf16 weight."""
    out_features, in_features = 100, 64
    weight = torch.randn(out_features, in_features).to(torch.bfloat16)
    blocks = packed_linear.pack_bf16(weight)
    q8 = torch.randint(0, 255, (out_features, in_features // 32, 34), dtype=torch.uint8)
    gguf = packed_linear.pack_blocks("Q8_0", q8)
    routes = ((1, "gguf"), (4, "dot"), (16, "onednn"), (600, "blocks"))
    packed = packed_linear.PackedWeight(None, blocks, torch.empty(0), gguf, bf16_routes=routes)
    layer = SimpleNamespace(
        qkv_weight=weight, o_weight=weight, gate_up_weight=weight, down_weight=weight, packed={"qkv": packed}
    )
    model = SimpleNamespace(layers=[layer], lm_head=None, _tied_head=None, embed_tokens=weight, _head_packed=None)
    plain = 2 * out_features * in_features
    others = {"torch": 4 * plain}  # o, gate_up, down and the head are not packed here
    assert gguf.nbytes == padded(out_features) * (in_features // 32) * 34 and blocks.nbytes == 2 * padded(100) * 64
    assert step_bytes.weight_read_bytes(model, 2, 1) == {"gguf": gguf.nbytes, **others}
    assert step_bytes.weight_read_bytes(model, 8, 1) == {"dot": blocks.nbytes, **others}
    assert step_bytes.weight_read_bytes(model, 64, 1) == {"onednn": plain, **others}
    assert step_bytes.weight_read_bytes(model, 700, 1) == {"torch": 5 * plain}  # blocks past BF16_MAX_ROWS


def test_a_bfloat16_model_is_held_to_the_faster_of_its_two_ceilings(monkeypatch):
    rates = {torch.float32: 70.0, torch.bfloat16: 19.0}
    monkeypatch.setattr(
        forward_sweep, "matmul_ceiling", lambda d, h, i, r: dict(gflops_by_shape={}, best_gflops=rates[d])
    )
    cfg = SimpleNamespace(hidden_size=64, intermediate_size=160)

    def worker(dtype, compute):
        return SimpleNamespace(dtype=dtype, model=SimpleNamespace(compute_dtype=compute), model_config=cfg)

    widened = forward_sweep.ceilings(worker(torch.bfloat16, torch.float32), 1)
    assert list(widened["by_dtype"]) == ["float32", "bfloat16"]
    assert (widened["best_dtype"], widened["best_gflops"]) == ("float32", 70.0)
    rates[torch.bfloat16] = 408.0  # a CPU with AVX512-BF16
    assert forward_sweep.ceilings(worker(torch.bfloat16, torch.float32), 1)["best_dtype"] == "bfloat16"
    plain = forward_sweep.ceilings(worker(torch.float32, torch.float32), 1)
    assert list(plain["by_dtype"]) == ["float32"] and plain["best_gflops"] == 70.0


def test_attention_rate_is_the_extra_kv_over_the_extra_time_of_a_longer_context():
    def row(sweep, context, step_ms, kv_bytes):
        return dict(sweep=sweep, context=context, step_ms=step_ms, kv_bytes=kv_bytes)

    rows = [
        row("batch", 256, 1.0, 1e9),
        row("context", 512, 30.0, 2e8),
        row("context", 256, 20.0, 1e8),
        row("context", 1024, 19.0, 4e8),  # faster than the shortest context: noise, no estimate
    ]
    forward_sweep.add_attention_rates(rows, copy_bps=2e10)
    assert rows[1]["attention_bytes_per_s"] == pytest.approx(1e8 / 0.010)
    assert rows[1]["attention_of_copy"] == pytest.approx(0.5)
    assert all("attention_of_copy" not in r for r in (rows[0], rows[2], rows[3]))


def test_bandwidths_are_positive_and_the_floor_takes_the_faster():
    b = membw.measure(rounds=1, nbytes=8 * membw.MIB)
    assert b["copy_bytes_per_s"] > 0 and b["read_bytes_per_s"] > 0
    assert b["floor_bytes_per_s"] == max(b["copy_bytes_per_s"], b["read_bytes_per_s"])
    assert membw.stream_bytes() >= max(membw.MIN_STREAM_BYTES, 4 * membw.llc_bytes())


def test_the_summary_gives_each_target_its_verdict_and_distrusts_an_attention_rate_past_the_read_rate():
    from bench import forward_sweep_report

    rows = [
        dict(dtype="bfloat16", sweep="batch", batch=1, context=256, tokens=1, step_ms=15.0, weight_floor_ms=10.0),
        dict(dtype="bfloat16", sweep="batch", batch=64, context=256, tokens=64, step_ms=100, fraction_of_ceiling=0.4),
        dict(dtype="bfloat16", sweep="context", batch=64, context=512, tokens=64, attention_of_copy=0.7),
    ]
    for row in rows:
        row.setdefault("weight_bytes", 1e8)
        row.setdefault("weight_floor_ms", 10.0)
    result = dict(
        rows=rows,
        ceiling=dict(bfloat16=dict(best_gflops=400.0, best_dtype="bfloat16", by_dtype={}, cpu_has_fast_bf16=True)),
        bandwidth=dict(
            bfloat16=dict(
                copy_bytes_per_s=1e10, read_bytes_per_s=9e9, floor_bytes_per_s=1e10, tensor_bytes=1 << 28, threads=2
            )
        ),
    )
    result["targets"] = dict(bfloat16=forward_sweep_report.issue_18_targets(rows))
    (targets,) = [line for line in forward_sweep_report.summary_lines(result, "bfloat16") if "targets" in line]
    assert "batch 64 at 0.40 of the ceiling (>= 0.6: NOT met)" in targets
    assert "batch 1 at 1.50x the weight-read floor (<= 2: met)" in targets
    assert "0.70 at context 512 of the copy bandwidth (>= 0.6 at the longest: met)" in targets
    rows[2]["attention_of_copy"] = 1.2  # 12 GB/s against a machine that read at most 10
    result["targets"] = dict(bfloat16=forward_sweep_report.issue_18_targets(rows))
    assert "unsure" in "".join(forward_sweep_report.summary_lines(result, "bfloat16"))
