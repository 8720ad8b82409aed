"""--deterministic: a request's tokens and logprobs do not depend on the rest of
the batch, on how its prefill is chunked, on a prefix-cache hit, on
preemption by recompute, on the thread count or on an executor restart
(docs/determinism.md). Each op's own invariance: test_deterministic_kernels.py.

Most cases drive a ModelRunner with step plans (tests/plan_driver.py) over a
tiny random Qwen2 saved as a Q8_0 GGUF: head_dim 64, so the native decode
kernel's AVX-512 path runs, and GGUF blocks, float32 panels and (bfloat16)
BF16 blocks all take part. Every comparison is exact: token ids, and the
logprob floats bit for bit.

The Triton kernels run in Triton's interpreter without a GPU (TRITON_INTERPRET=1,
set by tests/conftest.py).
"""

from __future__ import annotations

import pytest  # noqa: E402
import torch  # noqa: E402

from executor_svc import packed_linear  # noqa: E402
from executor_svc.attention import get_backend  # noqa: E402
from executor_svc.config import parse_config  # noqa: E402
from executor_svc.kv_cache import allocate_kv_caches  # noqa: E402
from executor_svc.model_loader import load_model  # noqa: E402
from executor_svc.model_runner import ModelRunner  # noqa: E402
from executor_svc.sampler import Sampler  # noqa: E402
from shared.sampling_params import SamplingParams  # noqa: E402
from tests.plan_driver import Job, PlanDriver  # noqa: E402

NATIVE = packed_linear.kernel() is not None and get_backend("cpu").name == "cpu"
needs_native = pytest.mark.skipif(not NATIVE, reason="--deterministic needs the AVX-512 native kernels")
BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, logprobs=2)
SEEDED = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, seed=1234, logprobs=2)


def make_runner(path: str, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> ModelRunner:
    backend = get_backend("cpu", batch_invariant=True)
    loaded = load_model(
        path, dtype, "cpu", backend, with_tokenizer=False, packed_gemm=True, gguf_blocks=True, batch_invariant=True
    )
    kv = allocate_kv_caches(loaded.config, 600, BLOCK, kv_dtype or dtype, torch.device("cpu"))
    return ModelRunner(loaded.model, kv, BLOCK, loaded.config.vocab_size, torch.device("cpu"), backend)


def prompts(n_tokens=(5, 23, 40, 70, 300)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 320, (n,), generator=gen).tolist() for n in n_tokens]


def jobs(arrive=(0, 0, 0, 0, 0), max_tokens: int = 10) -> list[Job]:
    return [
        Job(f"r{i}", p, max_tokens, GREEDY if i % 2 == 0 else SEEDED, arrive=arrive[i]) for i, p in enumerate(prompts())
    ]


def as_numbers(out) -> dict:
    """Token ids and every logprob (sampled and top) as floats: compared with ==, bit for bit."""
    return {rid: (o.tokens, [(lp.logprob, lp.top) for lp in o.logprobs]) for rid, o in out.items()}


@needs_native
@pytest.mark.parametrize(
    "dtype,kv_dtype",
    [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, torch.int8)],
    ids=["float32", "bfloat16", "bfloat16-int8-kv"],
)
def test_outputs_are_bit_identical_whatever_the_batch_chunking_prefix_preemption_or_threads(tiny_gguf, dtype, kv_dtype):
    driver = PlanDriver(make_runner(tiny_gguf, dtype, kv_dtype), BLOCK)
    alone = {}
    for job in jobs():
        alone.update(as_numbers(driver.run([job])))
    assert len({tuple(t) for t, _ in alone.values()}) == len(alone), "distinct prompts should give distinct outputs"
    scenarios = {
        "batched, staggered arrivals": dict(jobs=jobs((0, 2, 3, 5, 1))),
        # Prefill chunks of several sizes, beside other requests' decodes; the 300-token
        # prompt also passes 256 and 257 rows (once MKL's territory) with the big budget.
        "token budget 5": dict(jobs=jobs(), token_budget=5),
        "token budget 16": dict(jobs=jobs((0, 1, 1, 4, 0)), token_budget=16),
        "token budget 33": dict(jobs=jobs((0, 0, 3, 3, 1)), token_budget=33),
        "token budget 400": dict(jobs=jobs((2, 0, 0, 1, 0)), token_budget=400),
        "preempted and recomputed": dict(jobs=jobs((0, 0, 1, 1, 0)), preempt={"r0": 3, "r1": 5, "r3": 1, "r4": 7}),
    }
    for name, kw in scenarios.items():
        assert as_numbers(driver.run(**kw)) == alone, name
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        assert as_numbers(driver.run(jobs((0, 1, 2, 3, 4)), token_budget=64)) == alone, "another thread count"
    finally:
        torch.set_num_threads(threads)

    # A prefix-cache hit: r5 starts on r4's first 4 blocks (64 tokens of KV computed by r4's prefill).
    shared = prompts()[4][: 4 * BLOCK] + prompts()[2]
    fresh = driver.run([Job("r5", shared, 10, SEEDED)])
    hit = driver.run([Job("r5", shared, 10, SEEDED, prefix_of=("r4", 4))])
    assert as_numbers(hit) == as_numbers(fresh)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> str:
    """The default tiny Qwen2 (hidden 64, head_dim 16, qkv bias), float32 safetensors."""
    from tests.model_utils import save_tiny_hf_model

    folder = str(tmp_path_factory.mktemp("tiny_hf"))
    save_tiny_hf_model("qwen2", folder)
    return folder


def make_triton_runner(path: str, dtype: torch.dtype) -> ModelRunner:
    """The CUDA --deterministic path (worker.py) on CPU tensors in Triton's interpreter:
    Triton attention, the triton_invariant kernels for linears, head and norms, and
    the sampler's Triton row sums."""
    from executor_svc.sampler import RowOps

    backend = get_backend("triton", batch_invariant=True)
    loaded = load_model(path, dtype, "cpu", backend, with_tokenizer=False, batch_invariant=True)
    kv = allocate_kv_caches(loaded.config, 64, BLOCK, dtype, torch.device("cpu"))
    return ModelRunner(
        loaded.model,
        kv,
        BLOCK,
        loaded.config.vocab_size,
        torch.device("cpu"),
        backend,
        sampler=Sampler(RowOps.triton()),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_triton_path_outputs_are_bit_identical_whatever_the_batch_chunking_or_preemption(tiny_hf, dtype):
    """The runner-level case above, smaller, through the Triton path in the interpreter."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the interpreter case; bench/gpu_check.py runs the kernels on a GPU")
    driver = PlanDriver(make_triton_runner(tiny_hf, dtype), BLOCK)
    gen = torch.Generator().manual_seed(4)
    lengths = (5, 17, 30)
    prompts_ = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in lengths]

    def triton_jobs(arrive=(0, 0, 0)):
        return [Job(f"t{i}", p, 5, GREEDY if i % 2 == 0 else SEEDED, arrive=arrive[i]) for i, p in enumerate(prompts_)]

    alone = {}
    for job in triton_jobs():
        alone.update(as_numbers(driver.run([job])))
    assert len({tuple(t) for t, _ in alone.values()}) == len(alone), "distinct prompts should give distinct outputs"
    scenarios = {
        "batched, staggered arrivals": dict(jobs=triton_jobs((0, 2, 1))),
        "token budget 7": dict(jobs=triton_jobs(), token_budget=7),
        "token budget 19, preempted and recomputed": dict(
            jobs=triton_jobs((0, 1, 0)), token_budget=19, preempt={"t0": 2, "t2": 3}
        ),
    }
    for name, kw in scenarios.items():
        assert as_numbers(driver.run(**kw)) == alone, name


def test_deterministic_is_one_flag_and_refuses_the_torch_paths():
    assert parse_config(["--deterministic"]).deterministic
    assert not parse_config([]).deterministic
    assert parse_config([], environ={"PAGEDSERVE_DETERMINISTIC": "1"}).deterministic
    for flags in (
        ["--cpu-gemm", "torch"],
        ["--attention-backend", "torch"],
        ["--device", "cuda", "--attention-backend", "torch"],
    ):
        with pytest.raises(SystemExit):
            parse_config(["--deterministic", *flags])
    # --cpu-gemm does nothing on CUDA, so it does not stand in the way there.
    assert parse_config(["--deterministic", "--device", "cuda", "--cpu-gemm", "torch"]).deterministic
    from executor_svc.machine import check_deterministic_cuda, use_packed_gemm
    from executor_svc.sampler import RowOps
    from executor_svc.worker import sampler_for

    # CUDA: no packed GEMM (the Triton kernels take its place), one GPU, triton attention.
    assert not use_packed_gemm("auto", torch.device("cuda"), torch.float32, deterministic=True)
    check_deterministic_cuda("triton", 1)
    with pytest.raises(ValueError, match="triton attention"):
        check_deterministic_cuda("cpu", 1)
    with pytest.raises(ValueError, match="NCCL"):
        check_deterministic_cuda("triton", 2)
    # The sampler's row sums: torch's on CPU (per row there) and without the flag; Triton's on CUDA with it.
    assert sampler_for(torch.device("cpu"), True).ops == RowOps()
    assert sampler_for(torch.device("cuda"), False).ops == RowOps()
    assert sampler_for(torch.device("cuda"), True).ops == RowOps.triton() != RowOps()
    if NATIVE:  # even where the CPU has fast bf16 of its own, the packed kernel's sums are the invariant ones
        assert use_packed_gemm("auto", torch.device("cpu"), torch.bfloat16, deterministic=True)


@needs_native
@pytest.mark.e2e
def test_bfloat16_streams_resume_bit_identically_after_an_executor_sigkill(english_prompts):
    """The outside test's bf16 case: greedy and seeded streams interrupted by
    SIGKILL of the executor, recomputed by the scheduler in other batch
    shapes, end with the tokens and logprobs of an uninterrupted run."""
    import signal
    import time
    from concurrent.futures import ThreadPoolExecutor

    from pagedserve_client import Client
    from tests.servers import Servers

    jobs = [(f"{english_prompts[i % len(english_prompts)][: 30 + 9 * i]} ({i})", i) for i in range(8)]
    with (
        Servers(
            executor_args=["--dtype", "bfloat16", "--deterministic", "--kv-cache-gib", "0.5"],
            scheduler_args=["--executor-recovery-timeout", "180"],
        ) as s,
        Client(s.public_addr) as c,
    ):

        def run(job):
            prompt, i = job
            sampling = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.8, top_p=0.9, seed=100 + i)
            r = c.complete(prompt, max_tokens=24, ignore_eos=True, logprobs=1, timeout=600, **sampling)[0]
            return r.token_ids, [lp.logprob for lp in r.logprobs]

        with ThreadPoolExecutor(8) as pool:
            reference = list(pool.map(run, jobs))
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(run, j) for j in jobs]
            steps_before = c.server_status().num_steps
            deadline = time.monotonic() + 60  # bounded: a wait that cannot end hangs the suite
            while c.server_status().num_steps < steps_before + 6:
                assert time.monotonic() < deadline, "the engine did not take 6 steps in 60 s"
                time.sleep(0.02)
            s.executor.send_signal(signal.SIGKILL)
            s.executor.wait()
            assert not all(f.done() for f in futures), "the kill came too late to interrupt anything"
            s.start_executor()
            results = [f.result() for f in futures]
    assert [r[0] for r in results] == [r[0] for r in reference]
    assert results == reference  # logprobs too, bit for bit
