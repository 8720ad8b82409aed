"""A step that raises fails only its requests, with INTERNAL, and frees their blocks.

The real scheduler front end (gRPC server, engine, scheduler) runs in process
against a FakeExecutor behind a stand-in ExecutorConnection; the fake fails one
step for one request, as the executor reports a kernel exception.
"""

from __future__ import annotations

import asyncio
import collections

import grpc
from fake_executor import FakeExecutor, fake_executor_info

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.engine import Engine
from scheduler_svc.executor_connection import ExecutorInfo
from scheduler_svc.server import GenerationServicer
from tests.servers import free_port

VOCAB = 200


class FakeClient:
    """An ExecutorConnection over a FakeExecutor; fails one request on demand."""

    def __init__(self):
        self.executor: FakeExecutor | None = None
        self.fail_request: str | None = None
        self.steps_seen_with_target = 0
        self.results = collections.deque()

    async def connect(self, block_size, max_num_batched_tokens, max_num_seqs, timeout_s=5.0) -> ExecutorInfo:
        self.executor = FakeExecutor(
            block_size, 64, VOCAB, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        )
        return fake_executor_info(VOCAB)

    async def send(self, plan):
        ids = {r.request_id for r in plan.new_requests} | set(plan.cached_requests.request_ids)
        if self.fail_request in ids:
            self.steps_seen_with_target += 1
            if self.steps_seen_with_target == 3:
                self.executor.fail_next_step("RuntimeError: kernel exploded", [self.fail_request])
        self.results.append(self.executor.execute(plan))

    async def receive(self, plan):
        await asyncio.sleep(0.005)
        result = self.results.popleft()
        assert result.step_id == plan.step_id
        return result

    async def wait_lost(self):
        await asyncio.Event().wait()

    async def close(self):
        pass


async def scenario() -> None:
    client = FakeClient()
    engine = Engine(SchedulerServiceConfig(), client)
    await engine.connect()
    loop_task = asyncio.ensure_future(engine.run())
    server = grpc.aio.server()
    pb_grpc.add_GenerationServicer_to_server(GenerationServicer(engine, engine.config), server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    client.fail_request = "doomed"
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerationStub(channel)

            async def run(rid: str):
                req = pb.GenerateRequest(request_id=rid, text="w1 w2 w3 w4 w5")
                req.stopping.max_tokens, req.stopping.ignore_eos = 12, True
                return [m async for m in stub.Generate(req, timeout=30)]

            doomed, survivor = await asyncio.gather(run("doomed"), run("survivor"), return_exceptions=True)
            assert isinstance(doomed, grpc.aio.AioRpcError), doomed
            assert doomed.code() == grpc.StatusCode.INTERNAL and "kernel exploded" in doomed.details()
            assert not isinstance(survivor, BaseException), survivor
            assert survivor[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert sum(len(m.token_ids) for m in survivor) == 12
            status = await stub.GetServerStatus(pb.GetServerStatusRequest())
            assert status.kv_blocks_used == 0 and status.num_running == 0
            after = await run("after")  # the server keeps serving
            assert sum(len(m.token_ids) for m in after) == 12
    finally:
        loop_task.cancel()
        await server.stop(None)


def test_failed_step_fails_only_its_request_with_internal():
    asyncio.run(scenario())
