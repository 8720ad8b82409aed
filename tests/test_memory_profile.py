"""KV sizing on CUDA (memory_profile.py), checked on CPU: the budget arithmetic,
the measurement around the profiling step (with torch.cuda's counters faked),
and the profiling step itself, a real forward pass and sampling at the
scheduler's default limits on a tiny random model."""

from __future__ import annotations

import contextlib

import pytest
import torch
from model_utils import save_tiny_model_with_tokenizer

from executor_svc import memory_profile
from executor_svc.config import ExecutorConfig
from executor_svc.kv_cache import GIB, bytes_per_block
from executor_svc.memory_profile import cuda_kv_budget, dummy_prompt_lengths, kv_budget_bytes, profile_run
from executor_svc.sampler import Sampler
from executor_svc.worker import Worker
from shared.sampling_params import SamplingParams
from shared.step_plan import CachedRequestData, NewRequestData, StepPlan

BLOCK_SIZE = 16
# The scheduler's defaults (scheduler_svc/config.py): 256 requests sharing 2048 tokens.
MAX_TOKENS, MAX_SEQS = 2048, 256


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A random 2-layer Qwen2 (max_model_len 256) with a word-level tokenizer, as a Worker loads it."""
    folder = str(tmp_path_factory.mktemp("tiny_qwen2"))
    save_tiny_model_with_tokenizer(folder)
    return folder


def make_worker(folder: str, attention_backend: str = "auto") -> Worker:
    return Worker(ExecutorConfig(model=folder, dtype="float32", kv_cache_gib=0.01, attention_backend=attention_backend))


def greedy(worker: Worker, prompt: list[int], steps: int) -> list[int]:
    runner = worker.runner
    blocks = list(range(1, 1 + (len(prompt) + steps) // BLOCK_SIZE + 1))
    new = NewRequestData("r", prompt, len(prompt), SamplingParams(temperature=0.0), blocks, 0, len(prompt))
    out = [runner.execute(StepPlan(1, [new])).sampled["r"]]
    for step in range(2, steps + 1):
        computed = runner.requests["r"].num_computed_tokens
        out.append(
            runner.execute(StepPlan(step, cached_requests=CachedRequestData(["r"], [[]], [computed], [1]))).sampled["r"]
        )
    return out


def dummy_kv_bytes(worker: Worker, max_tokens: int, max_seqs: int) -> int:
    lengths = dummy_prompt_lengths(max_tokens, max_seqs, worker.max_model_len)
    num_blocks = 1 + sum(-(-n // BLOCK_SIZE) for n in lengths)
    return num_blocks * bytes_per_block(worker.model_config, BLOCK_SIZE, worker.kv_dtype)


# -- the arithmetic -----------------------------------------------------------------


def test_budget_is_the_capped_card_less_weights_activations_and_non_torch_memory():
    card = {"total_bytes": 80 * GIB, "utilization": 0.9, "baseline_bytes": 16 * GIB, "non_torch_bytes": GIB // 2}
    idle = kv_budget_bytes(peak_activation_bytes=0, **card)
    assert idle == int(0.9 * 80 * GIB) - 16 * GIB - GIB // 2
    # Every byte the profiled step peaked at is a byte less of KV.
    assert idle - kv_budget_bytes(peak_activation_bytes=3 * GIB + 7, **card) == 3 * GIB + 7


def test_configure_refuses_a_card_with_nothing_left(tiny_model, monkeypatch):
    worker = make_worker(tiny_model)
    budget = kv_budget_bytes(
        total_bytes=24 * GIB,
        utilization=0.5,
        baseline_bytes=10 * GIB,
        peak_activation_bytes=2 * GIB,
        non_torch_bytes=GIB // 2,
    )
    assert budget < 0
    monkeypatch.setattr(worker, "_kv_budget_bytes", lambda *args: budget)
    with pytest.raises(ValueError, match=r"no GPU memory left for the KV cache: raise --gpu-memory-utilization"):
        worker.configure(BLOCK_SIZE, MAX_TOKENS, MAX_SEQS)
    assert not worker.configured


@pytest.mark.parametrize(
    ("max_tokens", "max_seqs", "max_model_len"),
    [
        (2048, 256, 256),  # the scheduler's defaults on the tiny model
        (2048, 256, 8192),
        (8192, 4, 4096),
        (2048, 1, 256),  # one request cannot take more than max_model_len
        (100, 256, 4096),  # fewer tokens than requests: one token each
        (1, 1, 1),
        (0, 0, 16),  # nonsense limits still make a valid one-token step
    ],
)
def test_the_dummy_step_is_the_largest_the_scheduler_may_send(max_tokens, max_seqs, max_model_len):
    lengths = dummy_prompt_lengths(max_tokens, max_seqs, max_model_len)
    assert sum(lengths) == max(1, min(max_tokens, max_seqs * max_model_len))
    assert len(lengths) == max(1, min(max_seqs, sum(lengths)))
    assert all(1 <= n <= max_model_len for n in lengths)
    # The first request is as long as any one may be: the largest attention.
    assert lengths[0] == min(max_model_len, sum(lengths) - (len(lengths) - 1))


# -- the measurement, with torch.cuda's counters faked --------------------------------


class _Recorder:
    def __init__(self):
        self.lines = []

    def info(self, event, **fields):
        self.lines.append((event, fields))


def fake_cuda(monkeypatch, *, total, free, reserved, baseline, peak):
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *args: baseline)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args: peak)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *args: reserved)


def test_the_measured_peak_counts_activations_but_not_the_dummy_kv_blocks(tiny_model, monkeypatch):
    worker = make_worker(tiny_model)
    dummy_kv = dummy_kv_bytes(worker, MAX_TOKENS, MAX_SEQS)
    baseline, activations = 5 * GIB, 700 << 20
    # 9 GiB in use on a 16 GiB card, of which torch holds 8: 1 GiB is not torch's.
    fake_cuda(
        monkeypatch,
        total=16 * GIB,
        free=7 * GIB,
        reserved=8 * GIB,
        baseline=baseline,
        peak=baseline + dummy_kv + activations,
    )
    recorder = _Recorder()
    monkeypatch.setattr(memory_profile, "log", recorder)
    budget = cuda_kv_budget(worker.model, BLOCK_SIZE, worker.kv_dtype, MAX_TOKENS, MAX_SEQS, worker.max_model_len, 0.9)
    assert budget == int(0.9 * 16 * GIB) - baseline - activations - GIB
    [(event, fields)] = recorder.lines
    assert event == "memory_profile"
    assert fields["peak_activation_gib"] == round(activations / GIB, 3)
    assert fields["non_torch_gib"] == 1.0
    assert fields["kv_budget_gib"] == round(budget / GIB, 3)


def test_a_step_that_does_not_fit_names_the_scheduler_limits(tiny_model, monkeypatch):
    worker = make_worker(tiny_model)
    fake_cuda(monkeypatch, total=16 * GIB, free=7 * GIB, reserved=8 * GIB, baseline=GIB, peak=GIB)

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(memory_profile, "profile_run", out_of_memory)
    with pytest.raises(ValueError, match=r"2048 tokens over 256 requests does not fit .*--max-num-batched-tokens"):
        cuda_kv_budget(worker.model, BLOCK_SIZE, worker.kv_dtype, MAX_TOKENS, MAX_SEQS, worker.max_model_len, 0.9)


# -- the profiling step itself, for real on CPU ---------------------------------------


@pytest.mark.parametrize("attention_backend", ["cpu", "torch"])
@pytest.mark.parametrize(
    ("max_tokens", "max_seqs"),
    [
        (MAX_TOKENS, MAX_SEQS),  # prefills only: a 256-token one and 255 of 7 or 8 tokens
        (300, MAX_SEQS),  # a 45-token prefill and 255 one-token rows, which the backends run as decodes
    ],
)
def test_profile_run_then_the_worker_serves_as_before(tiny_model, attention_backend, max_tokens, max_seqs):
    profiled, fresh = make_worker(tiny_model, attention_backend), make_worker(tiny_model, attention_backend)
    dummy_kv = profile_run(profiled.model, BLOCK_SIZE, profiled.kv_dtype, max_tokens, max_seqs, profiled.max_model_len)
    assert dummy_kv == dummy_kv_bytes(profiled, max_tokens, max_seqs)
    for worker in (profiled, fresh):
        worker.configure(BLOCK_SIZE, MAX_TOKENS, MAX_SEQS)
    prompt = [(7 * j) % 300 + 3 for j in range(40)]
    assert greedy(profiled, prompt, 6) == greedy(fresh, prompt, 6)


class _FakeTP:
    def __init__(self, rank: int):
        self.rank = rank
        self.is_driver = rank == 0

    def fatal_on_error(self, what: str):
        return contextlib.nullcontext()


@pytest.mark.parametrize(("rank", "samples"), [(0, True), (1, False)])
def test_every_rank_runs_the_forward_and_only_rank_0_samples(tiny_model, monkeypatch, rank, samples):
    worker = make_worker(tiny_model)
    calls = []
    real_call = Sampler.__call__

    def recording_call(self, logits, md):
        calls.append(tuple(logits.shape))
        return real_call(self, logits, md)

    monkeypatch.setattr(Sampler, "__call__", recording_call)
    forwards = []
    worker.model.register_forward_hook(lambda module, args, out: forwards.append(out.shape[0]))
    profile_run(worker.model, BLOCK_SIZE, worker.kv_dtype, 300, 8, worker.max_model_len, _FakeTP(rank))
    assert forwards == [300]
    assert calls == ([(8, worker.model_config.vocab_size)] if samples else [])
