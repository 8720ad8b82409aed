"""The scheduler's step loop: schedule, send the plan, apply the result, stream.

One asyncio task runs the loop; gRPC handlers submit requests and read their
samples' outputs from per-request queues. Text work (detokenization, stop
strings) happens here, where the tokens arrive: a stop string aborts the
sample at once, so its blocks are free before the next step.

Executor loss: the scheduler holds every request's tokens, so when the Step
stream breaks it resets all running requests to "recompute from scratch",
reconnects, and carries on; clients only see a pause. Past the recovery
timeout their requests fail with UNAVAILABLE.

A hung executor (stopped, deadlocked, wedged on a device) breaks no stream, so
a step watchdog (step_watchdog.py) stands in: a plan not taken, or a result
not received, within --step-timeout counts as a loss like any other. The hung stream is cancelled
and never read again, so whatever it answers if it wakes up is discarded;
the executor serves the new stream only after a new handshake.
"""
from __future__ import annotations

import asyncio
import collections
import enum
import time
from dataclasses import dataclass, field

import structlog

from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.executor_connection import ExecutorConnection, ExecutorInfo, ExecutorLost, ExecutorRefused
from scheduler_svc.grammar import CompiledGrammar, Constraint, GrammarCompiler
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.request import Request, RequestOutput, RequestStatus
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.scheduler_config import SchedulerConfig
from scheduler_svc.step_watchdog import StepWatchdog
from scheduler_svc.tokenizer import Tokenizer
from shared.model_id import model_id
from shared.sampling_params import SamplingParams
from shared.step_plan import StepPlan, StepResult, TokenLogprobs

log = structlog.get_logger(__name__)


def _model_facts(info: ExecutorInfo) -> tuple:
    """What requests were tokenized and validated against (the context length is a capacity: it may change)."""
    return (info.model_name, info.vocab_size, info.eos_token_ids, info.tokenizer_json, info.chat_template)


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_FINISH = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class ExecutorHung(ExecutorLost):
    """A step went unanswered for longer than --step-timeout."""


class EngineUnavailable(RuntimeError):
    """The executor is not connected (or the server is draining)."""


class QueueFull(RuntimeError):
    """Too many requests are waiting."""


@dataclass(frozen=True)
class GenerationInput:
    """A validated request, ready to run: everything the engine needs."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams  # sample i uses (seed + i) mod 2**64 when a seed is set
    n: int
    max_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    priority: int = 0
    constraint: Constraint | None = None  # structured output; compile with Engine.compile_constraint


@dataclass
class SampleOutput:
    """One message of one sample's stream."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    matched_stop: str = ""
    matched_stop_token_id: int | None = None
    error: str = ""  # set when the sample failed inside the engine (INTERNAL)
    unavailable: bool = False  # set when the executor stayed away too long


@dataclass(eq=False)
class _Sample:
    handle: RequestHandle
    index: int
    request: Request
    detok: IncrementalDetokenizer
    first_scheduled: float | None = None
    last_token_time: float | None = None  # None until the first token


@dataclass(eq=False)
class RequestHandle:
    """What a gRPC handler holds: the queue its samples' outputs arrive on."""

    request_id: str
    n: int
    arrival: float = field(default_factory=time.monotonic)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    sample_ids: list[str] = field(default_factory=list)
    num_open: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0  # over all samples, for the request's log line
    owner: str = ""  # the caller that submitted it (shared.grpc_auth.Caller.name)


class Engine:
    def __init__(self, config, client: ExecutorConnection):
        self.config = config
        self.client = client
        self.info: ExecutorInfo | None = None
        self.tokenizer: Tokenizer | None = None
        self.scheduler: Scheduler | None = None
        self.grammars: GrammarCompiler | None = None
        self.max_model_len = 0  # the model's, capped by what one sequence can hold
        self.connected = False
        self.draining = False
        self._samples: dict[str, _Sample] = {}
        self._handles: dict[str, RequestHandle] = {}
        self._wakeup = asyncio.Event()
        self._on_connection_change = []  # callbacks(connected: bool)
        self._watchdog = StepWatchdog(config.step_timeout_s)
        self.metrics = SchedulerMetrics(self, config.metrics_prefix)
        # Totals for the periodic stats line (stats_logger.py): tokens the executor computed, tokens streamed.
        self.computed_tokens = 0
        self.generated_tokens = 0

    # ---- start-up and recovery -------------------------------------------------

    async def connect(self) -> ExecutorInfo:
        cfg = self.config
        info = await self.client.connect(cfg.block_size, cfg.max_num_batched_tokens, cfg.max_num_seqs)
        if self.info is None:
            self.info = info
            self.tokenizer = Tokenizer.from_info(info.tokenizer_json, info.chat_template, info.bos_token, info.eos_token, info.add_bos_token)
            config = self._scheduler_config(info)
            self.max_model_len = config.max_model_len
            self.scheduler = Scheduler(config)
            self.metrics.bind(self.config.served_model_name or model_id(info.model_name))
            self.grammars = GrammarCompiler(
                info.tokenizer_json, info.vocab_size, list(info.eos_token_ids), workers=cfg.grammar_compile_workers,
                cache_size=cfg.grammar_cache_size, timeout_s=cfg.grammar_compile_timeout_s)
        elif _model_facts(info) != _model_facts(self.info):
            # Requests were tokenized and validated for the old model: restart the scheduler to serve this one.
            await self.client.close()
            raise ExecutorRefused(f"the executor came back serving a different model ({info.model_name}, vocab "
                                  f"{info.vocab_size}); restart the scheduler")
        elif (info.num_kv_blocks, info.max_model_len) != (self.info.num_kv_blocks, self.info.max_model_len):
            # It lost every KV block anyway (reset_for_executor_loss ran): adopt the new capacity.
            try:
                config = self._scheduler_config(info)
            except ValueError as e:
                await self.client.close()
                raise ExecutorRefused(f"the executor came back with a KV capacity the scheduler cannot use: {e}") from e
            log.warning("executor_capacity_changed", old_blocks=self.info.num_kv_blocks, new_blocks=info.num_kv_blocks,
                        old_max_model_len=self.max_model_len, new_max_model_len=config.max_model_len)
            self.info, self.max_model_len = info, config.max_model_len
            for request in self.scheduler.resize(config):
                self._fail_sample(request.request_id, f"the executor restarted with less KV memory: this request's "
                                  f"{request.num_tokens} tokens no longer fit the {config.max_model_len} one request "
                                  "can hold", unavailable=True)
        self._set_connected(True)
        log.info("executor_connected", instance_id=info.instance_id, num_kv_blocks=info.num_kv_blocks, device=info.device)
        return info

    def _scheduler_config(self, info: ExecutorInfo) -> SchedulerConfig:
        cfg = self.config
        # One sequence must fit alone beside the watermark, or it could never
        # finish; without chunked prefill its whole recompute must fit a step.
        usable = info.num_kv_blocks - 1
        max_len = min(info.max_model_len, (usable - int(cfg.watermark * usable)) * cfg.block_size)
        if not cfg.enable_chunked_prefill:
            max_len = min(max_len, cfg.max_num_batched_tokens)
        if max_len < info.max_model_len:
            log.warning("max_model_len_capped", model_max_len=info.max_model_len, max_model_len=max_len,
                        reason="KV capacity" if cfg.enable_chunked_prefill else "no chunked prefill")
        return SchedulerConfig(
            block_size=cfg.block_size, num_blocks=info.num_kv_blocks, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=max_len,
            watermark=cfg.watermark, enable_prefix_caching=cfg.enable_prefix_caching,
            enable_chunked_prefill=cfg.enable_chunked_prefill, hash_algo=cfg.hash_algo,
        )

    def _set_connected(self, value: bool) -> None:
        self.connected = value
        for callback in self._on_connection_change:
            callback(value)

    def on_connection_change(self, callback) -> None:
        self._on_connection_change.append(callback)

    async def _recover(self, reason: str) -> None:
        log.warning("executor_lost", reason=reason, live_requests=len(self._samples))
        self._set_connected(False)
        self.scheduler.reset_for_executor_loss()
        deadline = time.monotonic() + self.config.executor_recovery_timeout_s
        refusal, pause_s = "", 0.25
        while True:
            try:
                await self.connect()
                return
            except ExecutorLost as e:
                if isinstance(e, ExecutorRefused):
                    if str(e) != refusal:  # waiting may not fix it: say so, once per reason
                        refusal = str(e)
                        log.error("executor_refused", error=refusal)
                    pause_s = min(2 * pause_s, 5.0)  # and do not hammer an executor that said no
                else:
                    pause_s = 0.25
                if time.monotonic() > deadline and self._samples:
                    log.error("executor_recovery_timeout", live_requests=len(self._samples), error=str(e))
                    for sample_id in list(self._samples):
                        self._fail_sample(sample_id, "", unavailable=True)
                await asyncio.sleep(pause_s)

    # ---- requests ---------------------------------------------------------------

    async def compile_constraint(self, gen: GenerationInput) -> CompiledGrammar | None:
        """The request's compiled constraint (None if it has none); raises GrammarError.

        Runs in a worker thread: other requests keep running while it compiles.
        The request keeps its arrival time, so it queues as if it had waited
        in the queue meanwhile.
        """
        return None if gen.constraint is None else await self.grammars.compile(gen.constraint)

    def submit(self, gen: GenerationInput, grammar: CompiledGrammar | None = None,
               arrival: float | None = None, owner: str = "") -> RequestHandle:
        if self.draining or not self.connected:
            raise EngineUnavailable("the server is draining" if self.draining else "the executor is unavailable")
        sample_ids = [gen.request_id] if gen.n == 1 else [f"{gen.request_id}#{i}" for i in range(gen.n)]
        # Sample ids share one namespace with plain request ids: a request named
        # "x#0" collides with sample 0 of a live "x" (n > 1), and vice versa.
        # Refuse before touching anything, or the live sample's stream is lost.
        if gen.request_id in self._handles or any(s in self._samples for s in sample_ids):
            raise KeyError(gen.request_id)
        if len(self.scheduler.waiting) + gen.n > self.config.max_waiting:
            raise QueueFull(f"{len(self.scheduler.waiting)} requests are waiting (limit --max-waiting {self.config.max_waiting})")
        handle = RequestHandle(gen.request_id, gen.n, prompt_tokens=len(gen.prompt_token_ids), owner=owner)
        if arrival is not None:
            handle.arrival = arrival
        eos = frozenset(self.info.eos_token_ids)
        masked = tuple(sorted(gen.stop_token_ids | (frozenset() if gen.ignore_eos else eos))) if gen.min_tokens else ()
        for i, sample_id in enumerate(sample_ids):
            # Seeds are uint64 end to end: sample i of a seed near 2**64 wraps around.
            seed = None if gen.sampling.seed is None else (gen.sampling.seed + i) % 2**64
            sampling = SamplingParams(**{**gen.sampling.__dict__, "seed": seed, "min_tokens": gen.min_tokens, "min_tokens_masked_ids": masked})
            request = Request(
                request_id=sample_id, prompt_token_ids=list(gen.prompt_token_ids), sampling=sampling,
                max_tokens=gen.max_tokens, eos_token_ids=eos, stop_token_ids=gen.stop_token_ids,
                ignore_eos=gen.ignore_eos, min_tokens=gen.min_tokens, priority=gen.priority, arrival_time=handle.arrival,
                grammar=None if grammar is None else grammar.matcher(),
            )
            detok = IncrementalDetokenizer(self.tokenizer, gen.prompt_token_ids, list(gen.stop), gen.include_stop_str_in_output)
            self._samples[sample_id] = _Sample(handle, i, request, detok)
            handle.sample_ids.append(sample_id)
            self.scheduler.add_request(request)
        handle.num_open = gen.n
        self._handles[gen.request_id] = handle
        self._wakeup.set()
        return handle

    def live_requests(self, owner: str | None = None) -> list[Request]:
        """The scheduler's live requests (running, then waiting); only `owner`'s unless None."""
        live = self.scheduler.live_requests()
        if owner is None:
            return live
        return [r for r in live if (s := self._samples.get(r.request_id)) is not None and s.handle.owner == owner]

    def abort(self, handle: RequestHandle) -> None:
        """Client went away: free every open sample's blocks now."""
        for sample_id in handle.sample_ids:
            sample = self._samples.get(sample_id)
            # A finished sample's id may be live again as another request's ("x#0").
            if sample is not None and sample.handle is handle:
                self.scheduler.abort_request(sample_id)
                self._samples.pop(sample_id)
                self._observe_finished(sample, FinishReason.ABORT)
        if self._handles.get(handle.request_id) is handle:
            del self._handles[handle.request_id]
            self._log_finished(handle, "abort")
        self._wakeup.set()

    def _fail_sample(self, sample_id: str, error: str, unavailable: bool = False) -> None:
        sample = self._samples.get(sample_id)
        if sample is None:
            return
        self.scheduler.abort_request(sample_id)
        req = sample.request
        self._finish(sample, SampleOutput(sample.index, [], "", finish_reason=FinishReason.ABORT, prompt_tokens=req.num_prompt_tokens,
                                          completion_tokens=req.num_output_tokens, error=error, unavailable=unavailable))

    def _finish(self, sample: _Sample, out: SampleOutput) -> None:
        self._samples.pop(sample.request.request_id, None)
        handle = sample.handle
        self._observe_finished(sample, out.finish_reason)
        handle.queue.put_nowait(out)
        handle.num_open -= 1
        if handle.num_open == 0 and self._handles.pop(handle.request_id, None) is not None:
            self._log_finished(handle, out.finish_reason.value if out.finish_reason else "")

    def _observe_finished(self, sample: _Sample, reason: FinishReason) -> None:
        """Every sample that ends, client aborts included, counts once in the per-request metrics."""
        m, req = self.metrics, sample.request
        m.request_success(reason.value).inc()
        m.prompt_tokens.inc(req.num_prompt_tokens)
        m.prompt_len.observe(req.num_prompt_tokens)
        m.generation_len.observe(req.num_output_tokens)
        m.e2e.observe(time.monotonic() - sample.handle.arrival)

    def _log_finished(self, handle: RequestHandle, reason: str) -> None:
        log.info("request_finished", request_id=handle.request_id, n=handle.n, finish_reason=reason,
                 prompt_tokens=handle.prompt_tokens, output_tokens=handle.output_tokens,
                 latency_s=round(time.monotonic() - handle.arrival, 4))

    # ---- the step loop ------------------------------------------------------------

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sample = self._samples.get(out.request_id)
            if sample is None:
                continue  # aborted while its step was in flight
            if out.error:
                self._fail_sample(out.request_id, out.error)
                continue
            req = sample.request
            self._observe_tokens(sample, len(out.new_token_ids))
            delta = sample.detok.add_tokens(out.new_token_ids, stops_armed=req.num_output_tokens >= req.min_tokens)
            msg = SampleOutput(sample.index, list(out.new_token_ids), delta.text, list(out.new_logprobs))
            if delta.matched_stop is not None:
                if not out.finished:
                    self.scheduler.abort_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                msg.finish_reason, msg.matched_stop = FinishReason.STOP, delta.matched_stop
            elif out.finished:
                msg.text += sample.detok.flush()
                if sample.detok.matched_stop is not None:  # completed by the final flush
                    msg.finish_reason, msg.matched_stop = FinishReason.STOP, sample.detok.matched_stop
                else:
                    msg.finish_reason = _FINISH[out.status]
                    msg.matched_stop_token_id = out.stop_token_id
            if msg.finish_reason is None:
                sample.handle.queue.put_nowait(msg)
                continue
            msg.prompt_tokens, msg.completion_tokens = req.num_prompt_tokens, req.num_output_tokens
            msg.cached_prompt_tokens = max(req.num_cached_tokens, 0)
            self._finish(sample, msg)

    def _observe_tokens(self, sample: _Sample, count: int) -> None:
        if not count:
            return
        now = time.monotonic()
        m = self.metrics
        if sample.last_token_time is None:
            m.ttft.observe(now - sample.handle.arrival)
        else:
            m.itl.observe((now - sample.last_token_time) / count)
        sample.last_token_time = now
        m.generation_tokens.inc(count)
        self.generated_tokens += count
        sample.handle.output_tokens += count

    def _observe_scheduled(self, plan) -> None:
        now = time.monotonic()
        for new in plan.new_requests:
            sample = self._samples.get(new.request_id)
            if sample is not None and sample.first_scheduled is None:
                sample.first_scheduled = now
                self.metrics.queue_time.observe(now - sample.handle.arrival)

    async def run(self) -> None:
        """The step loop; runs until cancelled.

        With overlap scheduling two plans are in flight: while the executor
        runs step N, the next plan is already on the wire, so the executor
        starts step N+1 as soon as N ends, and this loop applies N's result
        (detokenizing, streaming) while N+1 runs.

            executor:   | step N      | step N+1     | step N+2 ...
            scheduler:   plan N+1 ^     ^ apply N, plan N+2
        """
        self._watchdog.start()
        try:
            await self._loop()
        finally:
            self._watchdog.stop()

    async def _loop(self) -> None:
        sched = self.scheduler
        depth = 2 if self.config.overlap_scheduling else 1
        in_flight: collections.deque[StepPlan] = collections.deque()
        while True:
            if len(in_flight) < depth and sched.has_unfinished_requests():
                plan = sched.schedule()
                if plan.num_requests:
                    self._observe_scheduled(plan)
                    try:
                        await self._send(plan)
                    except ExecutorLost as e:
                        in_flight.clear()
                        await self._recover(str(e))
                        continue
                    in_flight.append(plan)
                    continue
            if not in_flight:
                if not sched.has_unfinished_requests():
                    if await self._idle_until_work_or_loss():
                        await self._recover("the executor connection dropped while idle")
                    continue
                # Nothing fits right now (every waiting request needs more free
                # blocks than exist); wait for a change instead of spinning.
                self._wakeup.clear()
                await asyncio.wait([asyncio.ensure_future(self._wakeup.wait())], timeout=0.05)
                continue
            plan = in_flight.popleft()
            try:
                failed = self._apply(plan, await self._receive(plan))
                # A failed step makes the plans sent behind it stale (the executor
                # refuses them): take their answers before planning again.
                while in_flight and failed:
                    plan = in_flight.popleft()
                    failed = self._apply(plan, await self._receive(plan))
            except ExecutorLost as e:
                in_flight.clear()
                await self._recover(str(e))

    # Both under the step watchdog: a wait longer than --step-timeout raises ExecutorHung.

    async def _send(self, plan: StepPlan) -> None:
        self._watchdog.arm()
        try:
            await self.client.send(plan)
        except asyncio.CancelledError:
            if not self._watchdog.claim():
                raise
            raise self._hung(plan, "taken") from None
        finally:
            self._watchdog.disarm()

    async def _receive(self, plan: StepPlan) -> StepResult:
        self._watchdog.arm()
        try:
            return await self.client.receive(plan)
        except asyncio.CancelledError:
            if not self._watchdog.claim():
                raise
            raise self._hung(plan, "answered") from None
        finally:
            self._watchdog.disarm()

    def _hung(self, plan: StepPlan, what: str) -> ExecutorHung:
        return ExecutorHung(f"step {plan.step_id} not {what} within --step-timeout {self.config.step_timeout_s:g} s")

    def _apply(self, plan: StepPlan, result: StepResult) -> bool:
        """Applies a step's result and streams its outputs; True if the step failed."""
        if result.error:
            log.error("step_failed", step_id=result.step_id, error=result.error, failed=len(result.failed_request_ids))
        self._deliver(self.scheduler.update_from_result(plan, result))
        if not result.error:
            self.computed_tokens += plan.total_num_scheduled_tokens
        log.debug("step", step_id=plan.step_id, num_requests=plan.num_requests,
                  num_tokens=plan.total_num_scheduled_tokens, execute_ms=result.execute_time_ns / 1e6)
        return bool(result.error)

    async def _idle_until_work_or_loss(self) -> bool:
        """Waits for a new request; True if the executor was lost meanwhile."""
        self._wakeup.clear()
        woke = asyncio.ensure_future(self._wakeup.wait())
        lost = asyncio.ensure_future(self.client.wait_lost())
        done, pending = await asyncio.wait({woke, lost}, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        return lost in done

    async def drain(self, timeout_s: float) -> None:
        """Stops admitting; waits up to timeout_s for live requests, then aborts the rest."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self._samples and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for sample_id in list(self._samples):
            self._fail_sample(sample_id, "")
