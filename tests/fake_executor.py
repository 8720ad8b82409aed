"""A stand-in for the executor process, plus an audit of the scheduler's bookkeeping.

FakeExecutor applies StepPlans with the real executor's request table
(executor_svc/request_table.py), so it accepts and refuses exactly the plans
ModelRunner does; a refused plan raises its PlanError out of `execute` (the
runner turns it into a failed step; here it is a scheduler bug and fails
the test). On top it audits promises the scheduler makes beyond the
protocol: step ids increase, finished ids name requests the executor holds,
prefix hits are block-aligned, block tables are exactly as long as the
tokens need, the batch limits hold. Its "model" is a rolling fingerprint:
the KV of position p is

    fp(p) = hash((fp(p - 1), token[p]))          fp(-1) = FP_SEED

so a KV slot identifies the whole prefix that produced it, and the token
sampled after a sequence is fp(last) % vocab_size: a pure function of the
sequence, so outputs survive preemption and recomputation unchanged. Under an
allowed-token mask it is the first allowed token at or after that one
(cyclically): still a pure function of the sequence and the mask.

Reading the cache checks that every slot of a request's prefix holds the
right fingerprint, which catches prefix-cache hits on wrong or never-written
blocks and blocks shared or reused while still in use.

Use:
    executor = FakeExecutor.for_scheduler(scheduler)
    plan = scheduler.schedule()
    outputs = scheduler.update_from_result(plan, executor.execute(plan))
    tokens_by_request = run_steps(scheduler, executor)   # or: step until idle
    audit(scheduler, executor)                           # bookkeeping checks
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from executor_svc.request_table import RequestState, RequestTable, StepBatch
from scheduler_svc.block_pool import hash_block_tokens
from scheduler_svc.executor_connection import ExecutorInfo
from scheduler_svc.scheduler import Scheduler
from shared.step_plan import StepPlan, StepResult, TokenLogprobs
from shared.token_mask import mask_width_bytes, unpack_allowed

FP_SEED = 0x5EED
GARBAGE = -1  # what a failed step leaves in the slots it was writing


def fingerprints(token_ids: list[int], start_fp: int = FP_SEED) -> list[int]:
    out = []
    fp = start_fp
    for token in token_ids:
        fp = hash((fp, token))
        out.append(fp)
    return out


def word_tokenizer_json(vocab_size: int) -> str:
    """A word-level tokenizer for the fake model's ids: "w1".."w{vocab_size - 1}", 0 = [UNK]."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{f"w{i}": i for i in range(1, vocab_size)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str()


def fake_executor_info(vocab_size: int, num_kv_blocks: int = 64, max_model_len: int = 512) -> ExecutorInfo:
    """The handshake answer of a stand-in executor serving the fake model."""
    return ExecutorInfo(
        model_name="fake",
        architecture="llama",
        vocab_size=vocab_size,
        eos_token_ids=(),
        bos_token_id=None,
        max_model_len=max_model_len,
        dtype="float32",
        num_kv_blocks=num_kv_blocks,
        kv_cache_bytes=0,
        instance_id="x",
        device="cpu",
        attention_backend="fake",
        tokenizer_json=word_tokenizer_json(vocab_size),
        chat_template="",
        bos_token="",
        eos_token="",
        add_bos_token=False,
    )


def reference_next_token(token_ids: list[int], vocab_size: int) -> int:
    """The token the fake executor samples after this sequence."""
    return fingerprints(token_ids)[-1] % vocab_size


@dataclass
class _ExecRequest(RequestState):
    fps: list[int] = field(default_factory=list)  # own fingerprints of token_ids[:len(fps)]

    def fps_up_to(self, end: int) -> list[int]:
        if len(self.fps) < end:
            start = self.fps[-1] if self.fps else FP_SEED
            self.fps += fingerprints(self.token_ids[len(self.fps) : end], start)
        return self.fps


class FakeExecutor:
    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        vocab_size: int = 1000,
        *,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        verify_kv: bool = True,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.verify_kv = verify_kv  # check every prefix slot each step (O(context)); else only the boundary
        self.kv: list[int | None] = [None] * (num_blocks * block_size)
        self.table = RequestTable(block_size, num_blocks, vocab_size, state_type=_ExecRequest)
        self.last_step_id = 0
        self.num_stale_plans = 0
        self.num_steps = 0
        self._fail_next: tuple[str, list[str] | None] | None = None

    @property
    def requests(self) -> dict[str, _ExecRequest]:
        """The live requests by id (the table's)."""
        return self.table.requests

    @classmethod
    def for_scheduler(cls, scheduler: Scheduler, vocab_size: int = 1000, **kwargs) -> FakeExecutor:
        cfg = scheduler.config
        return cls(
            cfg.block_size,
            cfg.num_blocks,
            vocab_size,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            **kwargs,
        )

    def fail_next_step(self, error: str = "injected failure", failed_request_ids: list[str] | None = None) -> None:
        """The next step fails: garbage lands in its slots, its requests are dropped.

        failed_request_ids defaults to every request in the step (what the
        real executor reports).
        """
        self._fail_next = (error, failed_request_ids)

    def _slot(self, req: _ExecRequest, position: int) -> int:
        return req.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, plan: StepPlan) -> StepResult:
        assert plan.step_id > self.last_step_id, f"step id {plan.step_id} after {self.last_step_id}"
        self.last_step_id = plan.step_id
        self.num_steps += 1
        if stale := self.table.refuse_if_stale(plan):
            self.num_stale_plans += 1
            return StepResult(step_id=plan.step_id, error=stale)
        batch = self.table.apply(plan)  # PlanError: the scheduler sent a plan the real executor refuses
        self._audit_plan(plan, batch)

        if self._fail_next is not None:
            error, failed_ids = self._fail_next
            self._fail_next = None
            for req, n in batch.rows:
                for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
                    self.kv[self._slot(req, pos)] = GARBAGE
            ids = self.table.drop_failed_step(plan)
            return StepResult(
                step_id=plan.step_id, error=error, failed_request_ids=ids if failed_ids is None else failed_ids
            )

        # Like the real model: the whole step's KV is written before anyone reads.
        for req, n in batch.rows:
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            fps = req.fps_up_to(end)
            for pos in range(start, end):
                self.kv[self._slot(req, pos)] = fps[pos]
        self._check_shared_blocks(batch.written_blocks)
        for req, n in batch.rows:
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            fps = req.fps_up_to(end)
            for pos in range(0, end) if self.verify_kv else range(max(start - 1, 0), end):
                got = self.kv[self._slot(req, pos)]
                assert got == fps[pos], (
                    f"{req.request_id!r}: KV at position {pos} (block {req.block_ids[pos // self.block_size]}) "
                    f"is {got}, expected {fps[pos]}"
                )
        self.table.mark_computed(batch)
        result = StepResult(step_id=plan.step_id)
        tokens = []
        for req in batch.sampling_states:
            rid = req.request_id
            token = req.fps[len(req.token_ids) - 1] % self.vocab_size
            if rid in plan.allowed_token_masks:
                token = _first_allowed(plan.allowed_token_masks[rid], token, self.vocab_size)
            tokens.append(token)
            result.sampled[rid] = token
            if req.sampling.logprobs is not None:
                top = [((token + k) % self.vocab_size, -1.0 - k) for k in range(req.sampling.logprobs)]
                result.logprobs[rid] = TokenLogprobs(logprob=-1.0, top=top)
        self.table.append_sampled(batch, tokens)
        return result

    def _audit_plan(self, plan: StepPlan, batch: StepBatch) -> None:
        """The scheduler's promises beyond what the executor's table requires of a plan."""
        bs = self.block_size
        assert not batch.unknown_finished_ids, (
            f"told to forget requests it does not hold: {batch.unknown_finished_ids} (the table ignores them)"
        )
        for new in plan.new_requests:
            assert new.num_computed_tokens % bs == 0, f"{new.request_id!r}: prefix hit not block-aligned"
        if self.max_num_seqs is not None:
            assert len(batch.rows) <= self.max_num_seqs, f"{len(batch.rows)} requests > max_num_seqs"
        if self.max_num_batched_tokens is not None:
            total = sum(n for _, n in batch.rows)
            assert total <= self.max_num_batched_tokens, f"{total} tokens > max_num_batched_tokens"
        for req, n in batch.rows:
            end = req.num_computed_tokens + n
            assert len(req.block_ids) == -(-end // bs), (
                f"{req.request_id!r}: {len(req.block_ids)} blocks for {end} tokens (block size {bs})"
            )

    def _check_shared_blocks(self, written: dict[int, str]) -> None:
        """Someone else may hold a block written now only as a prefix-cache hit
        on it, i.e. inside its computed prefix; its content must then be that
        request's own, once written."""
        bs = self.block_size
        for rid, req in self.requests.items():
            for index, b in enumerate(req.block_ids):
                writer = written.get(b)
                if writer is None or writer == rid:
                    continue
                end = (index + 1) * bs
                assert end <= req.num_computed_tokens, (
                    f"{rid!r} holds block {b} beyond its computed prefix while {writer!r} writes it"
                )
                fps = req.fps_up_to(end)[index * bs : end]
                assert self.kv[b * bs : (b + 1) * bs] == fps, (
                    f"{writer!r} wrote block {b} that {rid!r} holds as other content"
                )


def _first_allowed(mask: bytes, token: int, vocab_size: int) -> int:
    assert len(mask) == mask_width_bytes(vocab_size), f"mask of {len(mask)} bytes for vocabulary {vocab_size}"
    allowed = unpack_allowed(mask, vocab_size)
    assert allowed, "a mask allows no token"
    return next((t for t in allowed if t >= token), allowed[0])


def run_steps(
    scheduler: Scheduler, executor: FakeExecutor, max_steps: int = 100_000, *, overlap: bool = False
) -> dict[str, list[int]]:
    """Steps until no request is live; returns the tokens each request produced.

    overlap: like the engine's overlap scheduling, the next plan is made (and
    executed here) before the previous plan's result is applied.
    """
    tokens: dict[str, list[int]] = {}
    pipeline = Pipeline(scheduler, executor, depth=2 if overlap else 1)
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests() and not pipeline.in_flight:
            return tokens
        for out in pipeline.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError(f"requests still live after {max_steps} steps")


class Pipeline:
    """The engine's step loop over a FakeExecutor, without the asyncio: up to
    `depth` plans in flight (the fake runs a plan when it is sent; its result
    is applied later, in order), and after a failed step every plan in flight
    is answered before the next is made."""

    def __init__(self, scheduler: Scheduler, executor: FakeExecutor, depth: int) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.depth = depth
        self.in_flight: deque[tuple[StepPlan, StepResult]] = deque()

    def send(self, plan: StepPlan) -> None:
        self.in_flight.append((plan, self.executor.execute(plan)))

    def step(self, on_plan=None, apply=None):
        """Makes and sends a plan if there is room and work, else applies the oldest result.

        on_plan(plan) runs after the plan is made, before it is sent; apply(plan,
        result) replaces update_from_result. Returns the outputs applied.
        """
        apply = apply or self.scheduler.update_from_result
        if len(self.in_flight) < self.depth and self.scheduler.has_unfinished_requests():
            plan = self.scheduler.schedule()
            if on_plan is not None:
                on_plan(plan)
            if plan.num_requests:
                self.send(plan)
                if len(self.in_flight) < self.depth:
                    return []
        outputs = []
        while self.in_flight:
            plan, result = self.in_flight.popleft()
            outputs += apply(plan, result)
            if not result.error:
                break
        return outputs


# -- audit -------------------------------------------------------------------


def record_block_hashes(scheduler: Scheduler, registry: dict[bytes, list[int]]) -> None:
    """Recomputes every live request's block hashes from its tokens; remembers hash -> block fingerprints.

    Call it right after schedule(), when every hash registered by the plan
    belongs to a running request.
    """
    bs = scheduler.config.block_size
    hash_fn = scheduler.kv_cache_manager.block_pool.hash_fn
    for req in scheduler.requests.values():
        parent = None
        fps = fingerprints(req.all_token_ids[: len(req.block_hashes) * bs])
        for i, got in enumerate(req.block_hashes):
            parent = hash_block_tokens(hash_fn, parent, req.all_token_ids[i * bs : (i + 1) * bs])
            assert got == parent, f"{req.request_id!r}: block hash {i} does not match its tokens"
            registry[got] = fps[i * bs : (i + 1) * bs]


def audit(scheduler: Scheduler, executor: FakeExecutor | None = None, registry: dict | None = None) -> None:
    """Checks block accounting and request states; with executor+registry also cached KV content."""
    pool = scheduler.kv_cache_manager.block_pool
    bs = scheduler.config.block_size
    total = pool.num_total_blocks

    free_ids = []
    prev = pool.free_block_queue._head
    for block in pool.free_block_queue:
        assert block.prev_free is prev, f"free queue link broken before block {block.block_id}"
        assert block.ref_cnt == 0, f"block {block.block_id} is free with ref_cnt {block.ref_cnt}"
        free_ids.append(block.block_id)
        prev = block
    assert len(set(free_ids)) == len(free_ids), "a block is twice in the free queue"
    assert 0 not in free_ids, "the null block is in the free queue"
    assert len(free_ids) == pool.num_free_blocks, "free queue length != its counter"
    assert pool.num_free_blocks + pool.num_used_blocks == total

    holders: Counter[int] = Counter()
    for req in scheduler.requests.values():
        assert len(set(req.block_ids)) == len(req.block_ids), f"{req.request_id!r} holds a block twice"
        holders.update(req.block_ids)
    assert 0 not in holders, "a block table holds the null block"
    free_set = set(free_ids)
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders[block.block_id], (
            f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {holders[block.block_id]} tables"
        )
        assert (block.ref_cnt == 0) == (block.block_id in free_set), f"block {block.block_id} free-state mismatch"
    assert pool.null_block.ref_cnt == 0 and pool.null_block.block_hash is None

    hashed = [b for b in pool.blocks if b.block_hash is not None]
    assert len(hashed) == len(pool.cached_blocks), "hash map and hashed blocks disagree"
    for b in hashed:
        assert pool.cached_blocks[b.block_hash] is b, f"block {b.block_id}'s hash maps to another block"
    assert pool.num_cached_free_blocks == sum(1 for b in hashed if b.ref_cnt == 0), "cached-free counter is off"
    if registry is not None:
        for b in hashed:
            assert b.block_hash in registry, f"block {b.block_id} has a hash no request ever computed"
            if executor is not None:
                got = executor.kv[b.block_id * bs : (b.block_id + 1) * bs]
                assert got == registry[b.block_hash], f"cached block {b.block_id} holds other KV than its hash says"

    running, waiting = scheduler.running, list(scheduler.waiting)
    assert len(running) + len(waiting) == len(scheduler.requests), "running + waiting != live requests"
    assert len(running) <= scheduler.config.max_num_seqs
    for req in running:
        assert scheduler.requests.get(req.request_id) is req
        assert req.status.name == "RUNNING", f"{req.request_id!r} in running with status {req.status.name}"
        assert len(req.block_ids) == -(-req.num_computed_tokens // bs), (
            f"{req.request_id!r}: {len(req.block_ids)} blocks for {req.num_computed_tokens} computed tokens"
        )
        assert req.num_computed_tokens <= req.num_planned_tokens
    for req in waiting:
        assert scheduler.requests.get(req.request_id) is req
        assert req.status.name == "PREEMPTED" or not req.num_pending_samples, f"{req.request_id!r} waits for a sample"
        assert req.status.name in ("WAITING", "PREEMPTED"), f"{req.request_id!r} waits with {req.status.name}"
        assert not req.block_ids and req.num_computed_tokens == 0, f"waiting {req.request_id!r} holds KV state"
    if not scheduler.requests:
        assert pool.num_free_blocks == total, "no live request, yet blocks are held"
    if executor is not None:
        expected = {r.request_id for r in running} - set(scheduler._finished_ids)
        held = set(executor.requests) - set(scheduler._finished_ids)
        assert held == expected, f"executor holds {sorted(held)}, scheduler runs {sorted(expected)}"
