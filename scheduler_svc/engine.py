"""The scheduler's step loop: schedule, send the plan, apply the result, stream.

One asyncio task runs the loop; gRPC handlers submit requests and read their
samples' outputs from per-request queues. The engine wires four parts, each
with one job, and owns no logic of theirs:

    executor_link.py     handshake, step watchdog, loss, reconnection
    intake.py            submit: n > 1 fan-out, id and queue-limit checks
    output_processor.py  detokenizing, stop strings, per-sample output queues
    metrics.py           Prometheus series and the stats line's totals

Executor loss: the scheduler holds every request's tokens, so when the link
reports a loss (a broken stream, or a hung step) the engine resets all running
requests to "recompute from scratch" and the link reconnects; clients only see
a pause. Past the recovery timeout their requests fail with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import collections
import time

import structlog

from scheduler_svc.executor_connection import ExecutorConnection, ExecutorInfo, ExecutorLost
from scheduler_svc.executor_link import ExecutorLink
from scheduler_svc.grammar import CompiledGrammar, GrammarCompiler
from scheduler_svc.intake import GenerationInput, Intake
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.output_processor import OutputProcessor, RequestHandle
from scheduler_svc.request import Request
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.scheduler_config import SchedulerConfig, SchedulerPolicy
from scheduler_svc.tokenizer import Tokenizer
from shared.model_id import model_id
from shared.step_plan import StepPlan, StepResult

log = structlog.get_logger(__name__)


class EngineUnavailable(RuntimeError):
    """The executor is not connected (or the server is draining)."""


def scheduler_config_for(policy: SchedulerPolicy, info: ExecutorInfo) -> SchedulerConfig:
    """The scheduler's limits for this executor; raises ValueError if its KV capacity is unusable."""
    config = SchedulerConfig.for_executor(policy, info.num_kv_blocks, info.max_model_len)
    if config.max_model_len < info.max_model_len:
        log.warning(
            "max_model_len_capped",
            model_max_len=info.max_model_len,
            max_model_len=config.max_model_len,
            reason="KV capacity" if policy.enable_chunked_prefill else "no chunked prefill",
        )
    return config


class Engine:
    def __init__(self, config, client: ExecutorConnection):
        self.config = config
        self.client = client
        self.link = ExecutorLink(client, config)
        self.metrics = SchedulerMetrics(self, config.metrics_prefix)
        self.draining = False
        # Built at the first handshake, when the model is known.
        self.tokenizer: Tokenizer | None = None
        self.scheduler: Scheduler | None = None
        self.grammars: GrammarCompiler | None = None
        self.outputs: OutputProcessor | None = None
        self.intake: Intake | None = None
        self.max_model_len = 0  # the model's, capped by what one sequence can hold
        self._wakeup = asyncio.Event()

    @property
    def info(self) -> ExecutorInfo | None:
        return self.link.info

    @property
    def connected(self) -> bool:
        return self.link.connected

    def on_connection_change(self, callback) -> None:
        self.link.on_connection_change(callback)

    # ---- the step loop ------------------------------------------------------------

    async def run(self) -> None:
        """The step loop; runs until cancelled.

        With overlap scheduling two plans are in flight: while the executor
        runs step N, the next plan is already on the wire, so the executor
        starts step N+1 as soon as N ends, and this loop applies N's result
        (detokenizing, streaming) while N+1 runs.

            executor:   | step N      | step N+1     | step N+2 ...
            scheduler:   plan N+1 ^     ^ apply N, plan N+2
        """
        self.link.watch()
        try:
            await self._loop()
        finally:
            self.link.unwatch()

    async def _loop(self) -> None:
        depth = 2 if self.config.overlap_scheduling else 1
        in_flight: collections.deque[StepPlan] = collections.deque()
        while True:
            try:
                if len(in_flight) < depth and (plan := self._schedule()) is not None:
                    await self.link.send(plan)
                    in_flight.append(plan)
                elif in_flight:
                    await self._complete(in_flight)
                else:
                    await self._wait_for_work()
            except ExecutorLost as e:
                in_flight.clear()
                await self._recover(str(e))

    def _schedule(self) -> StepPlan | None:
        """The next plan, or None if there is nothing to run or nothing fits."""
        if not self.scheduler.has_unfinished_requests():
            return None
        plan = self.scheduler.schedule()
        if not plan.num_requests:
            return None
        self.outputs.observe_scheduled([new.request_id for new in plan.new_requests])
        return plan

    async def _complete(self, in_flight: collections.deque[StepPlan]) -> None:
        """Receives and applies the oldest plan's result."""
        plan = in_flight.popleft()
        failed = self._apply(plan, await self.link.receive(plan))
        # A failed step makes the plans sent behind it stale (the executor
        # refuses them): take their answers before planning again.
        while in_flight and failed:
            plan = in_flight.popleft()
            failed = self._apply(plan, await self.link.receive(plan))

    def _apply(self, plan: StepPlan, result: StepResult) -> bool:
        """Applies a step's result and streams its outputs; True if the step failed."""
        if result.error:
            log.error("step_failed", step_id=result.step_id, error=result.error, failed=len(result.failed_request_ids))
        ended = self.outputs.process(self.scheduler.update_from_result(plan, result))
        for request_id, status in ended.items():  # a stop string matched, or streaming the output failed
            self.scheduler.abort_request(request_id, status)
        if not result.error:
            self.metrics.observe_step(plan.total_num_scheduled_tokens)
        log.debug(
            "step",
            step_id=plan.step_id,
            num_requests=plan.num_requests,
            num_tokens=plan.total_num_scheduled_tokens,
            execute_ms=result.execute_time_ns / 1e6,
        )
        return bool(result.error)

    async def _wait_for_work(self) -> None:
        if self.scheduler.has_unfinished_requests():
            # Nothing fits right now (every waiting request needs more free
            # blocks than exist); wait for a change instead of spinning.
            self._wakeup.clear()
            await asyncio.wait([asyncio.ensure_future(self._wakeup.wait())], timeout=0.05)
        else:
            await self.link.idle(self._wakeup)  # raises ExecutorLost if the executor goes meanwhile

    # ---- the executor ---------------------------------------------------------------

    async def connect(self) -> ExecutorInfo:
        return await self.link.connect(self._adopt)

    def _adopt(self, info: ExecutorInfo, previous: ExecutorInfo | None) -> None:
        """Builds the scheduler's side for the first executor; resizes it for one that came back with other KV capacity."""
        cfg = self.config
        if previous is None:
            self.tokenizer = Tokenizer.from_info(
                info.tokenizer_json, info.chat_template, info.bos_token, info.eos_token, info.add_bos_token
            )
            config = scheduler_config_for(cfg.scheduler, info)
            self.max_model_len = config.max_model_len
            self.scheduler = Scheduler(config)
            self.metrics.bind(cfg.served_model_name or model_id(info.model_name))
            self.grammars = GrammarCompiler(
                info.tokenizer_json,
                info.vocab_size,
                list(info.eos_token_ids),
                workers=cfg.grammar_compile_workers,
                cache_size=cfg.grammar_cache_size,
                timeout_s=cfg.grammar_compile_timeout_s,
            )
            self.outputs = OutputProcessor(self.metrics)
            self.intake = Intake(
                self.scheduler,
                self.outputs,
                self.tokenizer,
                self.grammars,
                frozenset(info.eos_token_ids),
                cfg.max_waiting,
            )
            return
        config = scheduler_config_for(cfg.scheduler, info)
        log.warning(
            "executor_capacity_changed",
            old_blocks=previous.num_kv_blocks,
            new_blocks=info.num_kv_blocks,
            old_max_model_len=self.max_model_len,
            new_max_model_len=config.max_model_len,
        )
        self.max_model_len = config.max_model_len
        for request in self.scheduler.resize(config):
            self._fail(
                request.request_id,
                f"the executor restarted with less KV memory: this request's "
                f"{request.num_tokens} tokens no longer fit the {config.max_model_len} one request "
                "can hold",
                unavailable=True,
            )

    async def _recover(self, reason: str) -> None:
        self.link.lost(reason, live_requests=len(self.outputs))
        self.scheduler.reset_for_executor_loss()
        await self.link.reconnect(self._adopt, live=lambda: len(self.outputs), expire=self._fail_all_unavailable)

    def _fail_all_unavailable(self) -> None:
        for sample_id in self.outputs.sample_ids():
            self._fail(sample_id, "", unavailable=True)

    # ---- requests ---------------------------------------------------------------------

    async def compile_constraint(self, gen: GenerationInput) -> CompiledGrammar | None:
        """The request's compiled constraint (None if it has none); raises GrammarError. See Intake."""
        return await self.intake.compile_constraint(gen)

    def submit(
        self,
        gen: GenerationInput,
        grammar: CompiledGrammar | None = None,
        arrival: float | None = None,
        owner: str = "",
    ) -> RequestHandle:
        if self.draining or not self.connected:
            raise EngineUnavailable("the server is draining" if self.draining else "the executor is unavailable")
        handle = self.intake.submit(gen, grammar, arrival, owner)
        self._wakeup.set()
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Client went away: free every open sample's blocks now."""
        for sample_id in self.outputs.abort(handle):
            self.scheduler.abort_request(sample_id)
        self._wakeup.set()

    def live_requests(self, owner: str | None = None) -> list[Request]:
        """The scheduler's live requests (running, then waiting); only `owner`'s unless None."""
        live = self.scheduler.live_requests()
        if owner is None:
            return live
        return [r for r in live if self.outputs.owner(r.request_id) == owner]

    def _fail(self, sample_id: str, error: str, unavailable: bool = False) -> None:
        if sample_id in self.outputs:
            self.scheduler.abort_request(sample_id)
            self.outputs.fail(sample_id, error, unavailable)

    async def drain(self, timeout_s: float) -> None:
        """Stops admitting; waits up to timeout_s for live requests, then aborts the rest."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while len(self.outputs) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for sample_id in self.outputs.sample_ids():
            self._fail(sample_id, "")
