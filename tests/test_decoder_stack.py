"""The native decoder stack (executor_svc/decoder_stack.py) computes what the
Python layer loop computes, bit for bit, on the steps it takes, and leaves the
others to Python.

Two ModelRunners over the same weights run the same step plans
(tests/plan_driver.py): one with its DecoderStack, one with it removed; every
sampled token and every logprob float must be equal. The tiny Qwen2 (qkv
bias, head_dim 64) saved as Q8_0 GGUF exercises GGUF blocks (1-32 rows),
float32 panels (past 32 rows and the bf16 model's widened weights are BF16
blocks), both KV dtypes and both modes; the same model in Q4_1 and the
embedded SmolLM2 add Q4_1.
"""

from __future__ import annotations

import ctypes
from dataclasses import replace

import pytest
import torch

from executor_svc import decoder_stack, packed_linear
from executor_svc.attention import get_backend
from executor_svc.attention.metadata import AttentionMetadata
from executor_svc.kv_cache import allocate_kv_caches
from executor_svc.layer_ops import Kernels
from executor_svc.model_loader import load_model
from executor_svc.model_runner import ModelRunner
from shared.sampling_params import SamplingParams
from tests.plan_driver import Job, PlanDriver

NATIVE = packed_linear.kernel() is not None and get_backend("cpu").name == "cpu" and decoder_stack._lib() is not None
pytestmark = pytest.mark.skipif(not NATIVE, reason="the decoder stack needs the AVX-512 native kernels")
BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, logprobs=3)
SEEDED = SamplingParams(temperature=0.8, top_k=50, seed=7, logprobs=3)


def runner_pair(
    path: str, dtype: torch.dtype, batch_invariant: bool, kv_dtype: torch.dtype | None = None
) -> tuple[ModelRunner, ModelRunner]:
    """(with the stack, without it): two runners over one loaded model and two caches."""
    backend = get_backend("cpu", batch_invariant=batch_invariant)
    loaded = load_model(
        path,
        dtype,
        "cpu",
        backend,
        with_tokenizer=False,
        packed_gemm=True,
        gguf_blocks=True,
        batch_invariant=batch_invariant,
    )
    runners = []
    for _ in range(2):
        kv = allocate_kv_caches(loaded.config, 200, BLOCK, kv_dtype or dtype, torch.device("cpu"))
        runners.append(ModelRunner(loaded.model, kv, BLOCK, loaded.config.vocab_size, torch.device("cpu"), backend))
    assert runners[0].stack is not None, "the stack should apply to a CPU model on native kernels"
    runners[1].stack = None
    return runners[0], runners[1]


class Counting:
    """Wraps a stack, counting the steps it took."""

    def __init__(self, stack):
        self.stack, self.taken = stack, 0

    def forward(self, *args):
        out = self.stack.forward(*args)
        self.taken += out is not None
        return out


def jobs(vocab: int, lengths=(5, 23, 40, 70)) -> list[Job]:
    gen = torch.Generator().manual_seed(3)
    return [
        Job(f"r{i}", torch.randint(3, vocab, (n,), generator=gen).tolist(), 12, GREEDY if i % 2 else SEEDED, arrive=i)
        for i, n in enumerate(lengths)
    ]


def as_numbers(out) -> dict:
    return {rid: (o.tokens, [(lp.logprob, lp.top) for lp in o.logprobs]) for rid, o in out.items()}


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize(
    "dtype,kv_dtype",
    # int8: the stack writes K/V through kv_write_int8 and attends with the int8 decode kernel.
    [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, torch.int8)],
    ids=["float32", "bfloat16", "bfloat16-int8-kv"],
)
def test_stack_equals_the_python_layers_bit_for_bit(tiny_gguf, dtype, kv_dtype, batch_invariant):
    native, python = runner_pair(tiny_gguf, dtype, batch_invariant, kv_dtype)
    native.stack = counter = Counting(native.stack)
    work = jobs(320)
    # Budget 48: prompts arrive while others decode, so steps mix prefill
    # chunks and decodes (Python), and decode-only steps run 1-4 rows (the stack).
    got = as_numbers(PlanDriver(native, BLOCK).run(work, token_budget=48))
    want = as_numbers(PlanDriver(python, BLOCK).run(work, token_budget=48))
    assert got == want
    assert counter.taken >= 8, f"the stack took only {counter.taken} steps"


INT8 = NATIVE and packed_linear.kernel().int8_native


@pytest.mark.parametrize(
    "model, dtype, routed, how",
    [
        # A bfloat16 model routed to the dot kernel, as on a CPU with AVX512-BF16
        # (emulated here where the CPU lacks it): the stack rounds activations
        # to bfloat16 as packed_linear._bf16_dot does.
        ("tiny_gguf", torch.bfloat16, {"bf16_routes": ((1, "dot"),)}, "dot"),
        # And to the dot kernel over the file's Q4_1 blocks, which rounds them itself.
        ("tiny_gguf_q4_1", torch.bfloat16, {"bf16_routes": ((1, "gguf_dot"),)}, "gguf_dot"),
        # --gguf-activations int8: the stack calls the same quantising kernel.
        pytest.param(
            "tiny_gguf",
            torch.float32,
            {"int8_rows": 32},
            "int8",
            marks=pytest.mark.skipif(not INT8, reason="int8 activations need AVX512-VNNI"),
        ),
    ],
    ids=["bf16-dot", "bf16-gguf-dot", "int8"],
)
def test_stack_runs_the_other_packed_routes_as_python_does(request, model, dtype, routed, how):
    native, python = runner_pair(request.getfixturevalue(model), dtype, batch_invariant=False)
    for layer in native.model.layers:
        layer.packed = {name: replace(p, **routed) for name, p in layer.packed.items()}
    assert packed_linear.route(3, native.model.layers[0].packed["qkv"]) == how
    native.stack.refresh()
    native.stack = counter = Counting(native.stack)
    work = jobs(320, lengths=(9, 30, 17))
    assert as_numbers(PlanDriver(native, BLOCK).run(work)) == as_numbers(PlanDriver(python, BLOCK).run(work))
    assert counter.taken >= 8


@pytest.mark.parametrize("warm_blocks", [0, 1, 5, 1 << 20], ids=["off", "one-block", "five-blocks", "all"])
def test_warming_the_next_layers_keys_changes_no_output(tiny_gguf, warm_blocks):
    """On the dot route the stack's GEMMs prefetch the next attention's key
    blocks (decoder_stack.c): whatever the budget (none, part of a step's
    blocks, all of them), the numbers are the Python path's."""
    native, python = runner_pair(tiny_gguf, torch.bfloat16, batch_invariant=False)
    for layer in native.model.layers:
        layer.packed = {name: replace(p, bf16_routes=((1, "dot"),)) for name, p in layer.packed.items()}
    native.stack.refresh()
    model = native.stack._model
    assert model.block_bytes == native.kv_caches[0][0][0].numel() * 2
    model.warm_bytes = warm_blocks * model.block_bytes
    native.stack = counter = Counting(native.stack)
    work = jobs(320, lengths=(9, 30, 17, 50, 3))
    assert as_numbers(PlanDriver(native, BLOCK).run(work)) == as_numbers(PlanDriver(python, BLOCK).run(work))
    assert counter.taken >= 8


@pytest.mark.parametrize("warm_blocks", [0, 1 << 20], ids=["no-warming", "warming"])
def test_swiglu_on_the_gate_up_tiles_runs_as_python_does(tiny_gguf_whole_panels, warm_blocks):
    """Gate/up and down on the dot route, the intermediate size whole panels:
    the stack runs SwiGLU on the gate/up GEMM's tiles and hands the down GEMM
    its bf16 rows (as layer_ops.mlp does), warming its share of the next
    layer's keys; the numbers are the Python path's."""
    native, python = runner_pair(tiny_gguf_whole_panels, torch.bfloat16, batch_invariant=False)
    for layer in native.model.layers:
        layer.packed = {name: replace(p, bf16_routes=((1, "dot"),)) for name, p in layer.packed.items()}
    assert native.model.layers[0].down_weight.shape[1] % packed_linear.kernel().panel_width == 0
    native.stack.refresh()
    model = native.stack._model
    model.warm_bytes = warm_blocks * model.block_bytes
    # The fused and three-op MLPs give the same bits: count the fused pass's calls to know it ran.
    fused = packed_linear.kernel().gemm_bf16_dot_swiglu
    statuses = []
    spy = ctypes.CFUNCTYPE(ctypes.c_int, *fused.argtypes)(lambda *args: statuses.append(fused(*args)) or statuses[-1])
    model.swiglu_dot = ctypes.cast(spy, ctypes.c_void_p).value
    native.stack = counter = Counting(native.stack)
    work = jobs(320, lengths=(9, 30, 17, 50, 3))
    assert as_numbers(PlanDriver(native, BLOCK).run(work)) == as_numbers(PlanDriver(python, BLOCK).run(work))
    assert counter.taken >= 8
    layers = len(native.model.layers)
    assert len(statuses) == counter.taken * layers and set(statuses) == {0}, "the stack did not run the fused pass"


def test_an_intermediate_size_of_partial_panels_keeps_the_three_op_mlp(tiny_gguf):
    """320 is not whole 48-column panels: the stack is given no fused pass
    to try (it would decline after the stack had rounded the rows for it)."""
    native, _ = runner_pair(tiny_gguf, torch.bfloat16, batch_invariant=False)
    assert native.model.layers[0].down_weight.shape[1] % packed_linear.kernel().panel_width != 0
    assert native.stack._model.swiglu_dot is None


def test_stack_passes_the_dot_decode_route_as_python_does(tiny_gguf):
    """--decode-attention dot (attention/routes.py sets it on the backend after
    the stack is built): the stack hands the kernel the same arithmetic bits
    as the Python layers, so the runs agree bit for bit, and differ from the
    widening route's."""
    from executor_svc.attention import native_kernel

    if not native_kernel.dot_supported(4, 2, 64):
        pytest.skip("the decode kernel's dot path needs AVX-512BW")
    native, python = runner_pair(tiny_gguf, torch.bfloat16, batch_invariant=False)
    work = jobs(320, lengths=(9, 30, 17))
    widen = as_numbers(PlanDriver(python, BLOCK).run(work))
    native.model.attn_backend.use_decode_route("dot")
    assert python.model.attn_backend.decode_route == "dot"
    native.stack = counter = Counting(native.stack)
    got = as_numbers(PlanDriver(native, BLOCK).run(work))
    assert got == as_numbers(PlanDriver(python, BLOCK).run(work))
    assert counter.taken >= 8
    assert got != widen


def test_stack_takes_decodes_only_and_falls_back_elsewhere(tiny_gguf):
    native, _ = runner_pair(tiny_gguf, torch.float32, batch_invariant=False)
    native.stack = counter = Counting(native.stack)
    driver = PlanDriver(native, BLOCK)
    driver.run([Job("a", list(range(3, 40)), 1, GREEDY)])  # one prefill step, nothing decoded
    assert counter.taken == 0
    driver.run([Job("b", list(range(3, 40)), 4, GREEDY)])  # a prefill, then 3 decode steps
    assert counter.taken == 3


def test_a_step_with_a_non_native_route_runs_in_python(tiny_gguf, monkeypatch):
    native, python = runner_pair(tiny_gguf, torch.float32, batch_invariant=False)
    monkeypatch.setattr(decoder_stack, "route", lambda rows, packed: "torch")  # as if every GEMM went to MKL
    native.stack.refresh()
    native.stack = counter = Counting(native.stack)
    work = jobs(320, lengths=(9, 17))
    assert as_numbers(PlanDriver(native, BLOCK).run(work)) == as_numbers(PlanDriver(python, BLOCK).run(work))
    assert counter.taken == 0


def test_swapped_kernels_turn_the_stack_off(tiny_gguf):
    """A model whose Kernels were replaced (a test's spy, the CUDA invariant
    set) runs them: the stack never bypasses them."""
    native, _ = runner_pair(tiny_gguf, torch.float32, batch_invariant=False)
    calls = []

    def spy(*args):
        calls.append(1)
        return packed_linear.linear(*args)

    native.model.use_kernels(Kernels(linear=spy))
    native.stack = counter = Counting(native.stack)
    PlanDriver(native, BLOCK).run([Job("a", list(range(3, 20)), 3, GREEDY)])
    assert counter.taken == 0 and len(calls) == 3 * (4 * len(native.model.layers) + 1)


def test_embedded_smollm2_q4_1_decodes_identically():
    native, python = runner_pair_embedded()
    native.stack = counter = Counting(native.stack)
    work = [Job("a", list(range(100, 140)), 6, GREEDY), Job("b", list(range(500, 530)), 6, SEEDED, arrive=1)]
    assert as_numbers(PlanDriver(native, BLOCK).run(work)) == as_numbers(PlanDriver(python, BLOCK).run(work))
    assert counter.taken >= 4


def runner_pair_embedded() -> tuple[ModelRunner, ModelRunner]:
    from executor_svc.model_loader import default_model_path

    return runner_pair(default_model_path(), torch.float32, batch_invariant=False)


def test_struct_mirrors_match_the_c_layout():
    lib = decoder_stack._lib()
    assert decoder_stack.layout_differences(lib, decoder_stack.MIRRORS) == []
    # The check can fail: two same-size fields swapped, a field missing.
    fields = list(decoder_stack._Linear._fields_)
    swapped = type("Swapped", (ctypes.Structure,), {"_fields_": [fields[1], fields[0]] + fields[2:]})
    assert decoder_stack.layout_differences(lib, {"ds_linear": swapped}) != []
    short = type("Short", (ctypes.Structure,), {"_fields_": fields[:-1]})
    assert decoder_stack.layout_differences(lib, {**decoder_stack.MIRRORS, "ds_linear": short}) != []


def test_a_slot_outside_the_cache_raises_and_changes_nothing(tiny_gguf):
    native, _ = runner_pair(tiny_gguf, torch.float32, batch_invariant=False)
    PlanDriver(native, BLOCK).run([Job("a", list(range(3, 20)), 2, GREEDY)])
    caches = [(k.clone(), v.clone()) for k, v in native.kv_caches]
    h = torch.randn(1, native.model.config.hidden_size)
    h0 = h.clone()
    meta = AttentionMetadata(
        num_tokens=1,
        slot_mapping=torch.tensor([10**9], dtype=torch.int64),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([1], dtype=torch.int32),
        block_tables=torch.tensor([[1]], dtype=torch.int32),
        max_query_len=1,
        max_seq_len=1,
        block_size=BLOCK,
        query_lens_cpu=[1],
        seq_lens_cpu=[1],
    )
    native.attn_backend.prepare(meta)
    with pytest.raises(IndexError):
        native.stack.forward(h, native.model.rope_cos[:1], native.model.rope_sin_signed[:1], meta, native.kv_caches)
    assert torch.equal(h, h0), "h must not change when the step is refused"
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(native.kv_caches, caches))


@pytest.mark.parametrize("setting", ["auto", "off"])
def test_the_executor_option_turns_the_stack_on_and_off(setting):
    from executor_svc.config import ExecutorConfig
    from executor_svc.worker import Worker

    worker = Worker(ExecutorConfig(kv_cache_gib=0.01, dtype="float32", decoder_stack=setting))  # embedded model
    worker.configure(block_size=BLOCK, max_num_batched_tokens=64, max_num_seqs=4)
    assert (worker.runner.stack is not None) == (setting == "auto")


def test_wide_decode_batches_take_the_panels_route_bit_for_bit(tiny_gguf):
    """36 decodes at once: past the GGUF blocks' 32 rows, the float32 panels."""
    native, python = runner_pair(tiny_gguf, torch.float32, batch_invariant=False)
    native.stack = counter = Counting(native.stack)
    assert packed_linear.route(36, native.model.layers[0].packed["qkv"]) == "panels"
    gen = torch.Generator().manual_seed(5)
    work = [Job(f"w{i}", torch.randint(3, 320, (4 + i % 5,), generator=gen).tolist(), 3, GREEDY) for i in range(36)]
    assert as_numbers(PlanDriver(native, BLOCK).run(work)) == as_numbers(PlanDriver(python, BLOCK).run(work))
    assert counter.taken == 2  # one prefill step of all 36, then two steps of 36 decodes


def test_a_layer_whose_kernels_were_swapped_after_the_build_turns_the_stack_off(tiny_gguf):
    native, _ = runner_pair(tiny_gguf, torch.float32, batch_invariant=False)
    native.model.layers[1].kernels = Kernels(linear=lambda *args: packed_linear.linear(*args))
    native.stack = counter = Counting(native.stack)
    PlanDriver(native, BLOCK).run([Job("a", list(range(3, 20)), 3, GREEDY)])
    assert counter.taken == 0


def test_a_deterministic_prefill_does_not_keep_its_scratch(tiny_gguf):
    native, _ = runner_pair(tiny_gguf, torch.float32, batch_invariant=True)
    PlanDriver(native, BLOCK).run([Job("a", list(range(3, 303)), 2, GREEDY)])  # a 300-token step, then a decode
    kept = native.stack._scratch.numel()
    one_row = decoder_stack._lib().decoder_stack_scratch_floats(ctypes.byref(native.stack._model), 1)
    assert 0 < kept <= one_row * 4, f"kept {kept} floats after the 300-row step"
