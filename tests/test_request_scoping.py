"""What one caller may learn about another's requests, and work refused before tokenizing.

The real gRPC front end (interceptors, servicer, engine, scheduler) runs in
process against a FakeExecutor whose steps are held, so requests stay live
while the test looks at them.
"""

from __future__ import annotations

import asyncio
import collections

import grpc
import pytest
from fake_executor import FakeExecutor, fake_executor_info

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.engine import Engine
from scheduler_svc.executor_client import ExecutorInfo
from scheduler_svc.server import GenerationServicer
from scheduler_svc.validation import InvalidRequest, Limits, to_generation_input
from shared.grpc_auth import BearerAuthInterceptor, TokenTable

VOCAB = 200
ALICE, BOB, ADMIN = "alice-token-1", "bob-token-2", "admin-token-3"


class HeldClient:
    """ExecutorClient's interface over a FakeExecutor; results wait until `release` is set."""

    def __init__(self):
        self.release = asyncio.Event()
        self.results = collections.deque()

    async def connect(self, block_size, max_num_batched_tokens, max_num_seqs, timeout_s=5.0) -> ExecutorInfo:
        self.executor = FakeExecutor(
            block_size, 64, VOCAB, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        )
        return fake_executor_info(VOCAB)

    async def send(self, plan):
        self.results.append(self.executor.execute(plan))

    async def receive(self, plan):
        await self.release.wait()
        return self.results.popleft()

    async def wait_lost(self):
        await asyncio.Event().wait()

    async def close(self):
        pass


async def listing(tokens: TokenTable | None) -> dict[str, set[str]]:
    """Who sees which request ids while alice's and bob's requests are live."""
    client = HeldClient()
    engine = Engine(SchedulerServiceConfig(), client)
    await engine.connect()
    loop_task = asyncio.ensure_future(engine.run())
    server = grpc.aio.server(interceptors=[BearerAuthInterceptor(tokens)] if tokens else [])
    pb_grpc.add_GenerationServicer_to_server(GenerationServicer(engine, engine.config, tokens), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    md = lambda token: (("authorization", f"Bearer {token}"),) if tokens else ()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            calls = []
            for rid, token in (("alice-req", ALICE), ("bob-req", BOB)):
                req = pb.GenerateRequest(request_id=rid, text="w1 w2 w3")
                req.stopping.max_tokens, req.stopping.ignore_eos = 4, True
                calls.append(stub.Generate(req, metadata=md(token), timeout=30))
            readers = [asyncio.ensure_future(call.read()) for call in calls]
            while len(engine.live_requests()) < 2:
                await asyncio.sleep(0.01)
            seen = {}
            for name, token in (("alice", ALICE), ("bob", BOB), ("admin", ADMIN)):
                status = await stub.GetServerStatus(
                    pb.GetServerStatusRequest(include_requests=True), metadata=md(token)
                )
                seen[name] = {r.request_id for r in status.requests}
                assert status.num_running + status.num_waiting == 2  # counts stay global
            client.release.set()
            await asyncio.gather(*readers)
            for call in calls:
                call.cancel()
            return seen
    finally:
        loop_task.cancel()
        await server.stop(None)


def test_a_caller_sees_only_its_own_requests_unless_admin():
    seen = asyncio.run(listing(TokenTable((ALICE, BOB, ADMIN), (ADMIN,))))
    assert seen == {"alice": {"alice-req"}, "bob": {"bob-req"}, "admin": {"alice-req", "bob-req"}}


def test_without_auth_everyone_is_the_same_anonymous_caller():
    seen = asyncio.run(listing(None))
    assert all(ids == {"alice-req", "bob-req"} for ids in seen.values())


# ---- size limits come before any tokenizing ---------------------------------------------


class NoTokenizing:
    """A tokenizer that fails the test if anything is tokenized."""

    has_chat_template = True

    def __getattr__(self, name):
        raise AssertionError(f"tokenizer.{name} used for a request that is too large anyway")


LIMITS = Limits(
    vocab_size=VOCAB, max_model_len=100, max_n=4, max_stop_strings=4, max_stop_string_bytes=64, max_prompt_chars=1000
)


def chat(n: int, content: str) -> pb.GenerateRequest:
    req = pb.GenerateRequest()
    req.chat.messages.extend(pb.ChatMessage(role="user", content=content) for _ in range(n))
    return req


@pytest.mark.parametrize(
    "req",
    [
        pb.GenerateRequest(text="x" * 1001),
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 100)),
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[VOCAB + 5] * 300_000)),
        chat(100, "a"),
        chat(3, "y" * 400),
    ],
    ids=["text", "token_ids", "huge_token_ids", "messages", "chat_chars"],
)
def test_oversized_prompts_are_refused_before_tokenizing(req):
    with pytest.raises(InvalidRequest) as info:
        to_generation_input(req, NoTokenizing(), LIMITS)
    assert info.value.code == grpc.StatusCode.OUT_OF_RANGE
