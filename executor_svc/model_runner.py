"""Turns one step plan into one batched forward pass plus sampling.

The runner keeps each request's state between steps (its tokens, block table
and sampling settings), so a plan carries only deltas: a new request crosses
the wire once, then each step says how many tokens to compute and which blocks
were appended. The runner feeds back its own sampled tokens: the next decode
step of a request computes the token this runner sampled in the previous one.

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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import structlog
import torch

from executor_svc.attention import AttentionMetadata
from executor_svc.logit_edits import apply_logit_edits, build_logit_edits
from executor_svc.sampler import Sampler, build_sampling_metadata
from shared.sampling_params import SamplingParams
from shared.step_plan import StepPlan, StepResult

if TYPE_CHECKING:
    from executor_svc.attention.backend import AttentionBackend
    from executor_svc.model import KVCache, LlamaForCausalLM
    from executor_svc.tensor_parallel import TPGroup

log = structlog.get_logger(__name__)


@dataclass
class RequestState:
    request_id: str
    token_ids: list[int]  # prompt + outputs, including this runner's own samples
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


class PlanError(ValueError):
    """The plan contradicts the runner's state: a scheduler/executor desync."""


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
        self.requests: dict[str, RequestState] = {}
        self._last_failed_step_id = 0

    def reset(self) -> None:
        """Forgets every request and zeroes all KV memory (a scheduler handshook).

        Zeroing is what keeps one owner's data from the next: a plan may name
        any block id and claim its tokens are computed, and attention would
        read whatever is there. It costs one memset of the cache (2 GiB: ~0.6 s on
        this project's busy 2-core CPU) per handshake; a scheduler never relies on KV
        from before its handshake (after a loss it recomputes everything), so
        even its own reconnect loses nothing by it.
        """
        self.requests.clear()
        self._last_failed_step_id = 0
        for k, v in self.kv_caches:
            k.zero_()
            v.zero_()

    def execute(self, plan: StepPlan) -> StepResult:
        """Runs one step; on any failure drops the step's requests and reports it."""
        start = time.perf_counter_ns()
        scheduled_ids = [r.request_id for r in plan.new_requests] + list(plan.cached_requests.request_ids)
        if self.tp is not None and self.tp.is_driver:
            self.tp.send(("step", plan))  # the other ranks run this same method on it
        if plan.last_result_step_id < self._last_failed_step_id:
            # Sent before the scheduler saw that step fail (overlap scheduling): it
            # may name requests the failure dropped, or hit prefix blocks it left
            # unwritten. Run none of it; the scheduler recomputes its requests.
            for rid in plan.finished_request_ids + scheduled_ids:
                self.requests.pop(rid, None)
            result = StepResult(
                step_id=plan.step_id,
                error=f"stale plan: made before step "
                f"{self._last_failed_step_id} failed; its requests will be recomputed",
            )
            result.execute_time_ns = time.perf_counter_ns() - start
            return result
        try:
            result = self._execute(plan)
        except Exception as e:  # one step's failure must not take down the executor
            log.exception("step_failed", step_id=plan.step_id, request_ids=scheduled_ids)
            for rid in scheduled_ids:
                self.requests.pop(rid, None)
            self._last_failed_step_id = plan.step_id
            result = StepResult(
                step_id=plan.step_id, error=f"{type(e).__name__}: {e}", failed_request_ids=scheduled_ids
            )
        result.execute_time_ns = time.perf_counter_ns() - start
        return result

    def _apply_plan(self, plan: StepPlan) -> list[tuple[RequestState, int]]:
        """Updates request states from the plan; returns (state, num_scheduled) in batch order."""
        cached = plan.cached_requests
        lengths = {
            "request_ids": len(cached.request_ids),
            "new_block_ids": len(cached.new_block_ids),
            "num_computed_tokens": len(cached.num_computed_tokens),
            "num_scheduled_tokens": len(cached.num_scheduled_tokens),
        }
        if len(set(lengths.values())) > 1:  # zip below would silently drop the extra entries
            raise PlanError(
                "cached_requests arrays must be aligned, one entry per request; got "
                + ", ".join(f"{k}: {n}" for k, n in lengths.items())
            )
        for rid in plan.finished_request_ids:
            self.requests.pop(rid, None)
        if plan.new_requests:
            # Request ids join these lines to the scheduler's request_finished lines.
            log.debug("requests_added", step_id=plan.step_id, request_ids=[r.request_id for r in plan.new_requests])
        batch = []
        for new in plan.new_requests:
            if new.request_id in self.requests:
                raise PlanError(f"new request {new.request_id!r} is already known")
            # Checked here, not by the embedding lookup: a clear error, before any state changes on the device.
            if new.token_ids and not 0 <= min(new.token_ids) <= max(new.token_ids) < self.vocab_size:
                bad = next(t for t in new.token_ids if not 0 <= t < self.vocab_size)
                raise PlanError(
                    f"new request {new.request_id!r}: token id {bad} is outside the vocabulary "
                    f"(0..{self.vocab_size - 1})"
                )
            state = RequestState(
                new.request_id,
                list(new.token_ids),
                new.num_prompt_tokens,
                new.sampling,
                list(new.block_ids),
                new.num_computed_tokens,
            )
            self.requests[new.request_id] = state
            batch.append((state, new.num_scheduled_tokens))
        for rid, new_blocks, num_computed, num_scheduled in zip(
            cached.request_ids, cached.new_block_ids, cached.num_computed_tokens, cached.num_scheduled_tokens
        ):
            state = self.requests.get(rid)
            if state is None:
                raise PlanError(f"cached request {rid!r} is unknown to the executor")
            if num_computed != state.num_computed_tokens:
                raise PlanError(
                    f"request {rid!r}: plan says {num_computed} computed tokens, executor has {state.num_computed_tokens}"
                )
            state.block_ids.extend(new_blocks)
            batch.append((state, num_scheduled))
        for state, num_scheduled in batch:
            end = state.num_computed_tokens + num_scheduled
            if num_scheduled <= 0 or end > len(state.token_ids):
                raise PlanError(
                    f"request {state.request_id!r}: scheduling {num_scheduled} tokens from "
                    f"{state.num_computed_tokens} but only {len(state.token_ids)} are known"
                )
            if -(-end // self.block_size) > len(state.block_ids):
                raise PlanError(f"request {state.request_id!r}: {len(state.block_ids)} blocks cannot hold {end} tokens")
            if any(not 0 < b < self.num_blocks for b in state.block_ids):
                raise PlanError(f"request {state.request_id!r}: block id out of range 1..{self.num_blocks - 1}")
        return batch

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
    def _execute(self, plan: StepPlan) -> StepResult:
        result = StepResult(step_id=plan.step_id)
        tp = self.tp
        # Every rank holds the same state, so a bad plan fails on all of them;
        # with tp, `agreed` makes sure of it before anyone enters a collective.
        with tp.agreed("preparing the step") if tp else contextlib.nullcontext():
            batch = self._apply_plan(plan)
            # Only requests whose scheduled tokens reach the end of their known
            # tokens produce a token; a mid-prompt chunk produces none.
            sample_rows = [i for i, (s, n) in enumerate(batch) if s.num_computed_tokens + n == len(s.token_ids)]
            _check_masks(plan, [batch[i][0] for i in sample_rows])
            if batch:
                input_ids, positions, meta, cu = self.prepare_inputs(batch)
                self.attn_backend.prepare(meta)
        if not batch:
            return result
        with tp.fatal_on_error("the forward pass") if tp else contextlib.nullcontext():
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
        for state, n in batch:
            state.num_computed_tokens += n
        if not sample_rows:
            return result
        states = [batch[i][0] for i in sample_rows]
        if tp is not None and not tp.is_driver:
            for state, token in zip(states, tp.receive_tokens(len(states))):
                state.token_ids.append(token)
            return result
        try:
            logits = self.model.compute_logits(hidden[torch.as_tensor(cu[1:][sample_rows] - 1, device=self.device)])
            edits = build_logit_edits(
                [s.sampling for s in states],
                [plan.allowed_token_masks.get(s.request_id) for s in states],
                self.vocab_size,
                self.device,
            )
            if edits is not None:
                logits = apply_logit_edits(logits, edits)
            md = build_sampling_metadata(
                [s.sampling for s in states],
                [s.token_ids[: s.num_prompt_tokens] for s in states],
                [s.output_token_ids for s in states],
                self.vocab_size,
                self.device,
            )
            out = self.sampler(logits, md)
            tokens = out.sampled_token_ids.tolist()
        except Exception:
            if tp is not None:
                tp.send_tokens(None, len(states))  # the other ranks drop this step's requests too
            raise
        if tp is not None:
            tp.send_tokens(tokens, len(states))
        for state, token, lp in zip(states, tokens, out.logprobs):
            state.token_ids.append(token)
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
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
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


def _check_masks(plan: StepPlan, sampling: list[RequestState]) -> None:
    """A mask for a request that does not sample this step means the scheduler lost track of it."""
    if plan.allowed_token_masks:
        extra = set(plan.allowed_token_masks) - {s.request_id for s in sampling}
        if extra:
            raise PlanError(f"allowed-token masks for requests that do not sample this step: {sorted(extra)}")
