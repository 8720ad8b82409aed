"""Steps through CUDA graphs' static buffers (executor_svc/cuda_graphs.py).

Without a GPU the capture is replaced by a closure that runs the same
forward eagerly over the same static buffers and the metadata prepared at
"capture" time, which is what a replay computes: these tests check the
bookkeeping around the graphs (sizes, copies into the buffers, padding
rows and tokens, steps that must not replay) with Triton attention in its interpreter.
On a GPU the same tests capture real graphs (bench/cuda_check.py runs the
servers with graphs against transformers there).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from attention_utils import DEVICE, ON_GPU, triton_backend
from model_utils import load_hf_folder, save_tiny_hf_model

from executor_svc.cuda_graphs import NULL_SLOT, StepGraphs, graph_batch_sizes, graph_token_sizes
from executor_svc.kv_cache import allocate_kv_caches
from executor_svc.model_runner import ModelRunner
from shared.sampling_params import SamplingParams
from shared.step_plan import CachedRequestData, NewRequestData, StepPlan

BLOCK = 16
MAX_SEQS = 5
MAX_LEN = 256
MAX_TOKENS = 64  # mixed graphs of 16, 24, 32, 48 and 64 tokens
NUM_BLOCKS = 40


@pytest.mark.parametrize("max_batch", [1, 2, 5, 8, 9, 16, 17, 100, 256])
def test_every_batch_size_has_a_graph_at_most_15_rows_larger(max_batch):
    sizes = graph_batch_sizes(max_batch)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1
    for b in range(1, max_batch + 1):
        size = next(s for s in sizes if s >= b)
        assert size - b < 16 and (b > 8 or size < 2 * b)
    assert sizes[-1] - max_batch < 16


@pytest.mark.parametrize("max_tokens", [1, 16, 17, 100, 512, 513, 2048, 8192])
def test_every_token_count_up_to_2048_has_a_graph_at_most_half_again_or_255_tokens_larger(max_tokens):
    sizes = graph_token_sizes(max_tokens)
    assert sizes == sorted(set(sizes)) and sizes[0] == 16 and sizes[-1] <= 2048
    for t in range(1, min(max_tokens, 2048) + 1):
        size = next(s for s in sizes if s >= t)
        assert size <= max(16, 1.5 * t) or size - t < 256
    assert max_tokens > 2048 or sizes[-1] < max_tokens + 256


@pytest.fixture
def eager_capture(monkeypatch):
    """On CPU: a 'replay' runs the forward over the static buffers, as the graph would."""
    if ON_GPU:
        return
    replays = []

    def capture(self, forward, size, meta, pool):
        ids, pos = self.input_ids[:size], self.positions[:size]
        kind = "decode" if meta.max_query_len == 1 else "mixed"

        def run():
            replays.append((kind, size))
            return forward(ids, pos, meta)

        return run, None

    monkeypatch.setattr(StepGraphs, "_capture", capture)
    return replays


def runner(folder, graphs: bool) -> ModelRunner:
    backend = triton_backend()
    model = load_hf_folder(folder, backend, device=DEVICE)
    caches = allocate_kv_caches(model.config, NUM_BLOCKS, BLOCK, torch.float32, torch.device(DEVICE))
    r = ModelRunner(model, caches, BLOCK, model.config.vocab_size, torch.device(DEVICE), backend)
    if graphs:
        r.capture_graphs(MAX_SEQS, MAX_TOKENS, MAX_LEN)
        assert r.graphs is not None
    return r


def plans():
    """Prefills of 140 tokens (eager: more than MAX_TOKENS); decodes of 5 requests; r1 and r3
    finish and r5 takes r3's blocks beside 3 decodes (a mixed step, 45 tokens padded to 48);
    decodes of 3 (padded to 4: the padding row's old slot is r5's); r6 takes r1's blocks beside
    4 decodes (34 tokens padded to 48: the padding tokens' old slots are r5's and the decodes'
    of the mixed step before); decodes of 5, then 3 and 1; four 2-token prompts beside r5's decode
    (9 tokens, 5 requests and 5 attention tiles), then one 12-token prompt beside it (13 tokens:
    the attention tiles and request rows past its 2 are the step before's, which must not run
    again over this step's tokens)."""
    greedy = SamplingParams(temperature=0.0, logprobs=2)
    prompts = {f"r{i}": [3 + (7 * i + j) % 300 for j in range(10 + 9 * i)] for i in range(MAX_SEQS)}
    blocks = {rid: list(range(1 + 6 * i, 7 + 6 * i)) for i, rid in enumerate(prompts)}
    computed = {rid: len(p) for rid, p in prompts.items()}
    steps = iter(range(1, 100))

    def decode(rids, new=(), finished=()):
        plan = StepPlan(
            next(steps),
            list(new),
            CachedRequestData(list(rids), [[] for _ in rids], [computed[r] for r in rids], [1] * len(rids)),
            finished_request_ids=list(finished),
        )
        for rid in rids:
            computed[rid] += 1
        return plan

    def new(rid, length, blocks_of):
        computed[rid] = length
        prompt = [5 + (j * 3 + len(rid)) % 250 for j in range(length)]
        return NewRequestData(rid, prompt, length, greedy, blocks[blocks_of], 0, length)

    yield StepPlan(
        next(steps), [NewRequestData(r, p, len(p), greedy, blocks[r], 0, len(p)) for r, p in prompts.items()]
    )
    yield decode(list(prompts))
    yield decode(["r0", "r2", "r4"], [new("r5", 42, "r3")], ["r1", "r3"])
    yield decode(["r0", "r2", "r4"])
    yield decode(["r0", "r2", "r4", "r5"], [new("r6", 30, "r1")])
    yield decode(["r0", "r2", "r4", "r5", "r6"])
    yield decode(["r4", "r5", "r6"], finished=["r0", "r2"])
    yield decode(["r5"], finished=["r4", "r6"])
    yield decode(["r5"], [new("r7", 2, "r0"), new("r8", 2, "r1"), new("r9", 2, "r2"), new("r10", 2, "r4")])
    yield decode(["r5"], [new("r11", 12, "r0")], finished=["r7", "r8", "r9", "r10"])


def test_steps_through_the_graph_buffers_match_the_eager_runner(tmp_path, eager_capture):
    save_tiny_hf_model("llama_tied", str(tmp_path))
    eager, graphed = runner(str(tmp_path), False), runner(str(tmp_path), True)
    graphs = graphed.graphs
    for plan in plans():
        a, b = eager.execute(plan), graphed.execute(plan)
        assert not a.error and not b.error, (a.error, b.error)
        assert a.sampled == b.sampled
        tokens = len(plan.cached_requests) + sum(r.num_scheduled_tokens for r in plan.new_requests)
        sizes = graphs.token_sizes if plan.new_requests else graphs.sizes
        if tokens <= sizes[-1]:
            size = next(s for s in sizes if s >= tokens)
            assert (graphs.slot_mapping[tokens:size] == NULL_SLOT).all(), "padding must write to the null block"
        # Padded to another row count, a GEMM may sum in another order: equal to rounding.
        for rid, lp in a.logprobs.items():
            assert [t for t, _ in lp.top] == [t for t, _ in b.logprobs[rid].top]
            assert [x for _, x in lp.top] == pytest.approx([x for _, x in b.logprobs[rid].top], abs=1e-4)
    if not ON_GPU:
        # The 140-token prefill ran eagerly; every other step replayed its padded size.
        kinds = ["decode", "mixed", "decode", "mixed", "decode", "decode", "decode", "mixed", "mixed"]
        assert eager_capture == list(zip(kinds, [5, 48, 4, 48, 5, 4, 1, 16, 16]))
    # Padding wrote only into the null block: every other block is the eager runner's.
    for (ka, va), (kb, vb) in zip(eager.kv_caches, graphed.kv_caches):
        torch.testing.assert_close(ka[1:], kb[1:], rtol=0, atol=1e-5)
        torch.testing.assert_close(va[1:], vb[1:], rtol=0, atol=1e-5)


def test_a_step_wider_than_the_graphs_runs_eagerly(tmp_path, eager_capture):
    save_tiny_hf_model("llama_tied", str(tmp_path))
    r = runner(str(tmp_path), True)
    ids = torch.zeros(MAX_SEQS + 1, dtype=torch.int64, device=DEVICE)
    from executor_svc.attention.metadata import AttentionMetadata

    meta = AttentionMetadata(
        num_tokens=MAX_SEQS + 1,
        slot_mapping=ids,
        query_start_loc=torch.arange(MAX_SEQS + 2, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.ones(MAX_SEQS + 1, dtype=torch.int32, device=DEVICE),
        block_tables=torch.zeros(MAX_SEQS + 1, 1, dtype=torch.int32, device=DEVICE),
        max_query_len=1,
        max_seq_len=1,
        block_size=BLOCK,
        query_lens_cpu=[1] * (MAX_SEQS + 1),
        seq_lens_cpu=[1] * (MAX_SEQS + 1),
    )
    assert r.graphs.replay(ids, ids, meta) is None  # more requests than the largest decode graph
    rows = r.graphs.seq_rows  # a mixed step of as many requests: more than the graphs' rows for real ones
    many_ids = torch.zeros(rows + 1, dtype=torch.int64, device=DEVICE)
    starts = torch.tensor([0, *range(2, rows + 2)], dtype=torch.int32, device=DEVICE)
    many = dataclasses.replace(
        meta,
        num_tokens=rows + 1,
        slot_mapping=many_ids,
        query_start_loc=starts,
        seq_lens=torch.full((rows,), 2, dtype=torch.int32, device=DEVICE),
        block_tables=torch.zeros(rows, 1, dtype=torch.int32, device=DEVICE),
        max_query_len=2,
        query_lens_cpu=[2] + [1] * (rows - 1),
        seq_lens_cpu=[2] * rows,
        extra={"triton": (torch.arange(rows, dtype=torch.int32, device=DEVICE), many_ids[:rows].int())},
    )
    assert rows + 1 <= r.graphs.token_sizes[-1]  # only the request count rules this step out
    with torch.inference_mode():
        assert r.graphs.replay(many_ids, many_ids, many) is None
    two = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    wide = dataclasses.replace(
        meta,
        num_tokens=2,
        slot_mapping=two,
        query_start_loc=meta.query_start_loc[:3],
        seq_lens=meta.seq_lens[:2],
        block_tables=torch.zeros(2, MAX_LEN // BLOCK + 1, dtype=torch.int32, device=DEVICE),
        query_lens_cpu=[1, 1],
        seq_lens_cpu=[1, 1],
    )
    assert r.graphs.replay(two, two, wide) is None  # a block table wider than the graphs' buffer
    with torch.inference_mode():  # as ModelRunner._execute runs it
        assert r.graphs.replay(two, two, dataclasses.replace(wide, block_tables=wide.block_tables[:, :1])) is not None


@pytest.mark.skipif(ON_GPU, reason="the CPU-only refusal")
def test_a_failed_capture_leaves_the_runner_eager(tmp_path, monkeypatch):
    """Where an op cannot be captured the executor keeps serving, eagerly (here: no CUDA at all)."""
    save_tiny_hf_model("llama_tied", str(tmp_path))
    r = runner(str(tmp_path), False)
    r.capture_graphs(MAX_SEQS, MAX_TOKENS, MAX_LEN)
    assert r.graphs is None
    (plan, *_rest) = plans()
    assert not r.execute(plan).error
