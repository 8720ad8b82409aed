"""Turns one step plan into one batched forward pass plus sampling.

Each request's state between steps (its tokens, block table and sampling
settings) lives in a RequestTable (request_table.py), which applies each
plan's deltas and refuses inconsistent plans; the runner turns the table's
batch into tensors, runs the model and samples. It feeds back its own sampled
tokens: the next decode step of a request computes the token this runner
sampled in the previous one.

Per scheduled request the step computes tokens [num_computed, num_computed +
num_scheduled) of its token list, in the order the plan lists them (new
requests first, then cached ones):

    input_ids:  [ r0 chunk ........ | r1 | r2 | r3 chunk .. ]
    positions:  [ 0 1 2 ... 511     | 37 | 90 | 512 ... 767 ]
    sample at:                  ^     ^    ^
    (r3's chunk ends before its prompt does: no token for it this step)

With tensor parallelism (`tp` given) every rank runs `execute` on the same
plan: rank 0 relays the plan as it starts, all ranks prepare and run the
forward pass, and rank 0 alone computes logits and samples, then relays the
tokens so every rank's request state stays identical (tensor_parallel.py).
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import numpy as np
import structlog
import torch

from executor_svc.attention import AttentionMetadata
from executor_svc.cuda_graphs import StepGraphs
from executor_svc.decoder_stack import DecoderStack
from executor_svc.logit_edits import apply_logit_edits, build_logit_edits
from executor_svc.request_table import RequestState, RequestTable, scheduled_request_ids
from executor_svc.sampler import Sampler, SamplerOutput, build_sampling_metadata
from shared.sampling_params import SamplingParams
from shared.step_plan import StepPlan, StepResult

if TYPE_CHECKING:
    from executor_svc.attention.backend import AttentionBackend
    from executor_svc.model import KVCache, LlamaForCausalLM
    from executor_svc.tensor_parallel import TPGroup

log = structlog.get_logger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[KVCache],
        block_size: int,
        vocab_size: int,
        device: torch.device,
        attn_backend: AttentionBackend,
        tp: TPGroup | None = None,
        sampler: Sampler | None = None,
        decoder_stack: bool = True,
    ):
        self.model = model
        self.tp = tp
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.attn_backend = attn_backend
        self.num_blocks = kv_caches[0][0].shape[0]
        self.sampler = sampler or Sampler()
        self.table = RequestTable(block_size, self.num_blocks, vocab_size)
        # The layers of decode steps in one native call where this model and cache allow it.
        self.stack = DecoderStack.build(model, kv_caches) if decoder_stack and device.type == "cpu" else None
        self.graphs: StepGraphs | None = None  # CUDA: set by capture_graphs

    @property
    def requests(self) -> dict[str, RequestState]:
        """The live requests by id (the table's)."""
        return self.table.requests

    def reset(self) -> None:
        """Forgets every request and zeroes all KV memory (a scheduler handshook).

        Zeroing is what keeps one owner's data from the next: a plan may name
        any block id and claim its tokens are computed, and attention would
        read whatever is there. It costs one memset of the cache (2 GiB: ~0.6 s on
        this project's busy 2-core CPU) per handshake; a scheduler never relies on KV
        from before its handshake (after a loss it recomputes everything), so
        even its own reconnect loses nothing by it.
        """
        self.table.clear()
        for k, v in self.kv_caches:
            k.zero_()
            v.zero_()

    def execute(self, plan: StepPlan) -> StepResult:
        """Runs one step; on any failure drops the step's requests and reports it."""
        start = time.perf_counter_ns()
        if self.tp is not None and self.tp.is_driver:
            self.tp.send(("step", plan))  # the other ranks run this same method on it
        if stale := self.table.refuse_if_stale(plan):
            result = StepResult(step_id=plan.step_id, error=stale)
            result.execute_time_ns = time.perf_counter_ns() - start
            return result
        try:
            result = self._execute(plan)
        except Exception as e:  # one step's failure must not take down the executor
            log.exception("step_failed", step_id=plan.step_id, request_ids=scheduled_request_ids(plan))
            failed = self.table.drop_failed_step(plan)
            result = StepResult(step_id=plan.step_id, error=f"{type(e).__name__}: {e}", failed_request_ids=failed)
        result.execute_time_ns = time.perf_counter_ns() - start
        return result

    def prepare_inputs(self, batch: list[tuple[RequestState, int]]):
        """The step's packed inputs for (state, num_scheduled) pairs: ids, positions, attention metadata, cu_seqlens."""
        bs = self.block_size
        query_lens = np.array([n for _, n in batch], dtype=np.int64)
        starts = np.array([s.num_computed_tokens for s, _ in batch], dtype=np.int64)
        seq_lens = starts + query_lens
        cu = np.zeros(len(batch) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu[1:])
        num_tokens = int(cu[-1])
        # Row of each token and its position: position = start of its row + offset in row.
        row_of_token = np.repeat(np.arange(len(batch)), query_lens)
        positions = starts[row_of_token] + (np.arange(num_tokens) - cu[:-1][row_of_token])
        max_blocks = max(len(s.block_ids) for s, _ in batch)
        block_table = np.zeros((len(batch), max_blocks), dtype=np.int64)
        input_ids = np.empty(num_tokens, dtype=np.int64)
        for i, (state, n) in enumerate(batch):
            block_table[i, : len(state.block_ids)] = state.block_ids
            c = state.num_computed_tokens
            input_ids[cu[i] : cu[i] + n] = state.token_ids[c : c + n]
        slot_mapping = block_table[row_of_token, positions // bs] * bs + positions % bs
        dev = self.device
        meta = AttentionMetadata(
            num_tokens=num_tokens,
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            query_start_loc=torch.from_numpy(cu.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(block_table.astype(np.int32)).to(dev),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=bs,
            query_lens_cpu=query_lens.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        return torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), meta, cu

    @torch.inference_mode()
    def capture_graphs(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> None:
        """CUDA: decode steps of up to max_num_seqs requests, and other steps of up to
        max_num_batched_tokens tokens (at most 2,048), replay captured graphs from here on
        (cuda_graphs.py); where capturing fails, logged, they stay eager. Their memory
        (static buffers and the graphs' pool, logged) comes out of what
        --gpu-memory-utilization leaves free: the KV cache was sized before them."""
        on_cuda = self.device.type == "cuda"
        reserved = torch.cuda.memory_reserved(self.device) if on_cuda else 0
        start = time.perf_counter()
        try:
            self.graphs = StepGraphs(
                lambda ids, pos, meta: self.model(ids, pos, self.kv_caches, meta),
                self.attn_backend.name,
                max_num_seqs,
                max_num_batched_tokens,
                -(-max_model_len // self.block_size),
                self.block_size,
                self.device,
            )
        except Exception as e:  # an op that cannot be captured must cost speed, not the executor
            log.warning("cuda_graphs_failed", error=f"{type(e).__name__}: {e}")
            self.graphs = None
            return
        added = torch.cuda.memory_reserved(self.device) - reserved if on_cuda else 0
        log.info(
            "cuda_graphs_captured",
            batch_sizes=self.graphs.sizes,
            token_sizes=self.graphs.token_sizes,
            memory_mib=round(added / 2**20, 1),
            seconds=round(time.perf_counter() - start, 2),
        )

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model's forward over this runner's KV cache: a captured graph's where one
        fits the step, else through its decoder stack where it has one."""
        if self.graphs is not None and (out := self.graphs.replay(input_ids, positions, meta)) is not None:
            return out
        if self.stack is None:
            return self.model(input_ids, positions, self.kv_caches, meta)
        return self.model(input_ids, positions, self.kv_caches, meta, self.stack)

    @torch.inference_mode()
    def _execute(self, plan: StepPlan) -> StepResult:
        result = StepResult(step_id=plan.step_id)
        tp = self.tp
        # Every rank holds the same state, so a bad plan fails on all of them;
        # with tp, `agreed` makes sure of it before anyone enters a collective.
        with tp.agreed("preparing the step") if tp else contextlib.nullcontext():
            batch = self.table.apply(plan)
            if batch.rows:
                input_ids, positions, meta, cu = self.prepare_inputs(batch.rows)
                self.attn_backend.prepare(meta)
        if batch.unknown_finished_ids:
            # Harmless here (nothing to forget), but the scheduler promises never to: a sign of desync.
            log.warning("finished_ids_unknown", step_id=plan.step_id, request_ids=batch.unknown_finished_ids)
        if plan.new_requests:
            # Request ids join these lines to the scheduler's request_finished lines.
            log.debug("requests_added", step_id=plan.step_id, request_ids=[r.request_id for r in plan.new_requests])
        if not batch.rows:
            return result
        with tp.fatal_on_error("the forward pass") if tp else contextlib.nullcontext():
            hidden = self._forward(input_ids, positions, meta)
        self.table.mark_computed(batch)
        states = batch.sampling_states
        if not states:
            return result
        if tp is not None and not tp.is_driver:
            self.table.append_sampled(batch, tp.receive_tokens(len(states)))
            return result
        try:
            last = hidden[torch.as_tensor(cu[1:][batch.sample_rows] - 1, device=self.device)]
            edits = build_logit_edits(
                [s.sampling for s in states],
                [plan.allowed_token_masks.get(s.request_id) for s in states],
                self.vocab_size,
                self.device,
            )
            md = build_sampling_metadata(
                [s.sampling for s in states],
                [s.token_ids[: s.num_prompt_tokens] for s in states],
                [s.output_token_ids for s in states],
                self.vocab_size,
                self.device,
            )
            if edits is None and md.needs_only_argmax:
                # Greedy rows and nothing else: the sampler would take the
                # logits' argmax, which the head can give without them.
                out = SamplerOutput(self.model.greedy_tokens(last), [None] * len(states))
            else:
                logits = self.model.compute_logits(last)
                if edits is not None:
                    logits = apply_logit_edits(logits, edits)
                out = self.sampler(logits, md)
            tokens = out.sampled_token_ids.tolist()
            if tokens and max(tokens) >= self.vocab_size:  # the sampler's shape check, which greedy_tokens skips
                raise ValueError(f"sampled token {max(tokens)} is outside the vocabulary of {self.vocab_size}")
        except Exception:
            if tp is not None:
                tp.send_tokens(None, len(states))  # the other ranks drop this step's requests too
            raise
        if tp is not None:
            tp.send_tokens(tokens, len(states))
        self.table.append_sampled(batch, tokens)
        for state, token, lp in zip(states, tokens, out.logprobs):
            result.sampled[state.request_id] = token
            if lp is not None:
                result.logprobs[state.request_id] = lp
        return result

    @torch.inference_mode()
    def profile_run(self, prompt_lengths: list[int], params: list[SamplingParams]) -> None:
        """Runs one step of dummy prefills, one per length, each sampling one row
        with its `params`, over blocks 1.. of this runner's KV cache (which must
        hold them all): the largest step memory profiling measures
        (memory_profile.py). Leaves no request state behind.

        Not through `execute`: with tensor parallelism every rank runs the
        forward (its all-reduces need all of them), only rank 0 samples, and
        nothing may enter execute's plan and token relays. The caller makes
        any failure here end the tensor-parallel job, as in a step.
        """
        batch, next_block = [], 1
        for i, (n, sampling) in enumerate(zip(prompt_lengths, params, strict=True)):
            num_blocks = -(-n // self.block_size)
            token_ids = [t % self.vocab_size for t in range(n)]
            block_ids = list(range(next_block, next_block + num_blocks))
            batch.append((RequestState(f"profile-{i}", token_ids, n, sampling, block_ids, 0), n))
            next_block += num_blocks
        assert next_block <= self.num_blocks, (
            f"the profiling step needs {next_block} blocks, the cache has {self.num_blocks}"
        )
        # Laid out exactly as a real step would be.
        input_ids, positions, meta, cu = self.prepare_inputs(batch)
        self.attn_backend.prepare(meta)
        hidden = self._forward(input_ids, positions, meta)
        if self.tp is None or self.tp.is_driver:
            logits = self.model.compute_logits(hidden[torch.as_tensor(cu[1:] - 1, device=self.device)])
            # Equal logits put top-p's nucleus beyond its candidate tokens (in
            # any vocabulary above 4551), so every row takes the full-sort path.
            logits.zero_()
            md = build_sampling_metadata(
                params, [s.token_ids for s, _ in batch], [[] for _ in batch], self.vocab_size, self.device
            )
            self.sampler(logits, md)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
