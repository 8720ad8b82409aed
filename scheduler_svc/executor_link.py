"""The engine's hold on the executor: handshake, loss detection, reconnection.

The scheduler holds every request's tokens, so an executor loss costs only
time: the engine resets its running requests to "recompute from scratch", this
link reconnects, and clients see a pause. Past --executor-recovery-timeout the
live requests fail with UNAVAILABLE (the engine's `expire`), and the link keeps
trying for the requests that come later.

A hung executor (stopped, deadlocked, wedged on a device) breaks no stream, so
the step watchdog (step_watchdog.py) stands in: a plan not taken, or a result
not received, within --step-timeout raises ExecutorHung, a loss like any other.
The hung stream is cancelled and never read again, so whatever it answers if
it wakes up is discarded; the executor serves a new stream only after a new
handshake.

Policy stays with the engine: what a handshake means for the scheduler
(`adopt`: build it the first time, resize it when the KV capacity changed) and
what to do with requests that waited too long. The link refuses an executor
that came back serving a different model, since every live request was
tokenized and validated for the old one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from scheduler_svc.executor_connection import ExecutorConnection, ExecutorInfo, ExecutorLost, ExecutorRefused
from scheduler_svc.step_watchdog import StepWatchdog
from shared.step_plan import StepPlan, StepResult

log = structlog.get_logger(__name__)

# adopt(info, previous): make the scheduler fit this executor; previous is None at the first handshake.
# Raises ValueError if its KV capacity cannot be used.
Adopt = Callable[[ExecutorInfo, "ExecutorInfo | None"], None]


class ExecutorHung(ExecutorLost):
    """A step went unanswered for longer than --step-timeout."""


def _model_facts(info: ExecutorInfo) -> tuple:
    """What requests were tokenized and validated against (the context length is a capacity: it may change)."""
    return (info.model_name, info.vocab_size, info.eos_token_ids, info.tokenizer_json, info.chat_template)


class ExecutorLink:
    def __init__(self, client: ExecutorConnection, config):
        self.client = client
        # step_timeout_s, executor_recovery_timeout_s; the policy (block_size, the batch limits) in .scheduler
        self._config = config
        self.info: ExecutorInfo | None = None  # the last handshake's
        self.connected = False
        self._on_connection_change: list[Callable[[bool], None]] = []
        self._watchdog = StepWatchdog(config.step_timeout_s)

    def on_connection_change(self, callback: Callable[[bool], None]) -> None:
        self._on_connection_change.append(callback)

    def _set_connected(self, value: bool) -> None:
        self.connected = value
        for callback in self._on_connection_change:
            callback(value)

    # ---- handshake, loss, reconnection ------------------------------------------

    async def connect(self, adopt: Adopt) -> ExecutorInfo:
        """Handshakes; raises ExecutorLost if unreachable, ExecutorRefused if refused or unusable."""
        policy = self._config.scheduler
        info = await self.client.connect(policy.block_size, policy.max_num_batched_tokens, policy.max_num_seqs)
        previous = self.info
        if previous is None:
            self.info = info
            adopt(info, None)
        elif _model_facts(info) != _model_facts(previous):
            # Requests were tokenized and validated for the old model: restart the scheduler to serve this one.
            await self.client.close()
            raise ExecutorRefused(
                f"the executor came back serving a different model ({info.model_name}, vocab "
                f"{info.vocab_size}); restart the scheduler"
            )
        elif (info.num_kv_blocks, info.max_model_len) != (previous.num_kv_blocks, previous.max_model_len):
            # It lost every KV block anyway (reset_for_executor_loss ran): adopt the new capacity.
            try:
                adopt(info, previous)
            except ValueError as e:
                await self.client.close()
                raise ExecutorRefused(f"the executor came back with a KV capacity the scheduler cannot use: {e}") from e
            self.info = info
        self._set_connected(True)
        log.info(
            "executor_connected", instance_id=info.instance_id, num_kv_blocks=info.num_kv_blocks, device=info.device
        )
        return info

    def lost(self, reason: str, live_requests: int) -> None:
        log.warning("executor_lost", reason=reason, live_requests=live_requests)
        self._set_connected(False)

    async def reconnect(self, adopt: Adopt, live: Callable[[], int], expire: Callable[[], None]) -> None:
        """Connects again, however long it takes; past the recovery timeout, expires the live requests."""
        deadline = time.monotonic() + self._config.executor_recovery_timeout_s
        refusal, pause_s = "", 0.25
        while True:
            try:
                await self.connect(adopt)
                return
            except ExecutorLost as e:
                if isinstance(e, ExecutorRefused):
                    if str(e) != refusal:  # waiting may not fix it: say so, once per reason
                        refusal = str(e)
                        log.error("executor_refused", error=refusal)
                    pause_s = min(2 * pause_s, 5.0)  # and do not hammer an executor that said no
                else:
                    pause_s = 0.25
                if time.monotonic() > deadline and (num_live := live()):
                    log.error("executor_recovery_timeout", live_requests=num_live, error=str(e))
                    expire()
                await asyncio.sleep(pause_s)

    async def idle(self, work: asyncio.Event) -> None:
        """Waits for `work` to be set; raises ExecutorLost if the connection drops first."""
        work.clear()
        woke = asyncio.ensure_future(work.wait())
        lost = asyncio.ensure_future(self.client.wait_lost())
        done, pending = await asyncio.wait({woke, lost}, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        if lost in done:
            raise ExecutorLost("the executor connection dropped while idle")

    # ---- steps, under the step watchdog -------------------------------------------

    def watch(self) -> None:
        """Starts the step watchdog on the calling task (the step loop)."""
        self._watchdog.start()

    def unwatch(self) -> None:
        self._watchdog.stop()

    async def send(self, plan: StepPlan) -> None:
        self._watchdog.arm()
        try:
            await self.client.send(plan)
        except asyncio.CancelledError:
            if not self._watchdog.claim():
                raise
            raise self._hung(plan, "taken") from None
        finally:
            self._watchdog.disarm()

    async def receive(self, plan: StepPlan) -> StepResult:
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
        return ExecutorHung(f"step {plan.step_id} not {what} within --step-timeout {self._config.step_timeout_s:g} s")
