"""The step watchdog: a hung executor (no answer, no broken stream) counts as lost.

The real engine runs in process against a FakeExecutor behind a stand-in
ExecutorClient whose stream can hang the way a SIGSTOPped executor's does: the
plan is written, no result ever comes, nothing breaks. Within --step-timeout
the executor must count as lost (disconnected, recovery timer running); if it
comes back the requests resume by recompute with the tokens they would have
had anyway, and if it stays away they fail UNAVAILABLE. Either way every KV
block is free afterwards. tests/test_faults.py does the same with SIGSTOP.
"""

from __future__ import annotations

import asyncio
import collections
import time

import pytest
from fake_executor import FakeExecutor, fake_executor_info, reference_next_token

from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.engine import Engine
from scheduler_svc.executor_client import ExecutorInfo, ExecutorLost
from scheduler_svc.intake import GenerationInput
from shared.sampling_params import SamplingParams

VOCAB, STEP_TIMEOUT_S = 200, 0.3
PROMPT = [5, 6, 7, 8, 9]


class HangingClient:
    """ExecutorClient's interface over a FakeExecutor whose Step stream can hang or be gone."""

    def __init__(self):
        self.hang = False  # results stop coming (the executor is stopped)
        self.down = False  # handshakes fail (the executor is unreachable)
        self.streams = 0
        self.results = collections.deque()

    async def connect(self, block_size, max_num_batched_tokens, max_num_seqs, timeout_s=5.0) -> ExecutorInfo:
        if self.down or self.hang:
            await asyncio.sleep(0.01)
            raise ExecutorLost("handshake timed out")
        # A new stream on a fresh executor state: the old stream's answers can never arrive on it.
        self.streams += 1
        self.executor = FakeExecutor(
            block_size, 64, VOCAB, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        )
        self.results = collections.deque()
        return fake_executor_info(VOCAB)

    async def send(self, plan):
        self.results.append(self.executor.execute(plan))

    async def receive(self, plan):
        await asyncio.sleep(0.002)
        results = self.results
        while self.hang:
            await asyncio.sleep(0.01)
        # Woke up late: the answer is for a stream the engine gave up on, if it still listens.
        result = results.popleft()
        assert result.step_id == plan.step_id
        return result

    async def wait_lost(self):
        await asyncio.Event().wait()

    async def close(self):
        pass


def expected_tokens(n: int) -> list[int]:
    tokens = list(PROMPT)
    for _ in range(n):
        tokens.append(reference_next_token(tokens, VOCAB))
    return tokens[len(PROMPT) :]


async def start(recovery_timeout_s: float) -> tuple[Engine, HangingClient, asyncio.Task, list[bool]]:
    client = HangingClient()
    engine = Engine(
        SchedulerServiceConfig(step_timeout_s=STEP_TIMEOUT_S, executor_recovery_timeout_s=recovery_timeout_s), client
    )
    changes: list[bool] = []
    engine.on_connection_change(changes.append)
    await engine.connect()
    return engine, client, asyncio.ensure_future(engine.run()), changes


def submit(engine: Engine, request_id: str, max_tokens: int):
    return engine.submit(
        GenerationInput(request_id, list(PROMPT), SamplingParams(temperature=0.0), 1, max_tokens, ignore_eos=True)
    )


async def collect(handle) -> tuple[list[int], object]:
    tokens = []
    while True:
        out = await handle.queue.get()
        tokens += out.token_ids
        if out.finish_reason is not None:
            return tokens, out


async def hang_until_lost(engine: Engine, client: HangingClient) -> float:
    while engine.scheduler.stats().num_steps < 3:
        await asyncio.sleep(0.005)
    client.hang = True
    hung_at = time.monotonic()
    while engine.connected:
        assert time.monotonic() - hung_at < STEP_TIMEOUT_S + 1.0, "a hung executor went unnoticed"
        await asyncio.sleep(0.01)
    return time.monotonic() - hung_at


async def executor_that_comes_back() -> None:
    engine, client, loop_task, changes = await start(recovery_timeout_s=30)
    try:
        handle = submit(engine, "a", 40)
        done = asyncio.ensure_future(collect(handle))
        noticed_s = await hang_until_lost(engine, client)
        assert noticed_s >= STEP_TIMEOUT_S * 0.9 and changes[-1] is False
        assert not done.done()
        client.hang = False  # SIGCONT
        tokens, last = await asyncio.wait_for(done, 10)
        assert not last.unavailable and not last.error
        assert tokens == expected_tokens(40), "recomputed tokens differ: a stale answer leaked in"
        assert engine.connected and changes[-1] is True and client.streams == 2
        assert engine.scheduler.stats().kv_blocks_used == 0
        tokens, _ = await asyncio.wait_for(collect(submit(engine, "b", 5)), 10)
        assert tokens == expected_tokens(5)
    finally:
        loop_task.cancel()


async def executor_that_stays_hung() -> None:
    engine, client, loop_task, _ = await start(recovery_timeout_s=0.5)
    try:
        handle = submit(engine, "a", 400)
        done = asyncio.ensure_future(collect(handle))
        await hang_until_lost(engine, client)
        _, last = await asyncio.wait_for(done, 10)
        assert last.unavailable, "in-flight requests must fail UNAVAILABLE after the recovery timeout"
        assert engine.scheduler.stats().kv_blocks_used == 0 and not engine.live_requests()
        client.hang = False
        deadline = time.monotonic() + 5
        while not engine.connected:
            assert time.monotonic() < deadline, "did not reconnect once the executor answered again"
            await asyncio.sleep(0.01)
        tokens, _ = await asyncio.wait_for(collect(submit(engine, "b", 5)), 10)
        assert tokens == expected_tokens(5)
        assert engine.scheduler.stats().kv_blocks_used == 0
    finally:
        loop_task.cancel()


@pytest.mark.parametrize("scenario", [executor_that_comes_back, executor_that_stays_hung])
def test_hung_executor_is_lost_within_step_timeout(scenario):
    asyncio.run(asyncio.wait_for(scenario(), 30))
