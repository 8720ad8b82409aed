"""The scheduler's edge to the executor: handshake, then one Step stream.

Protobuf stays in this file; the engine sees `ExecutorInfo`, `StepPlan` and
`StepResult` dataclasses. Any transport failure surfaces as `ExecutorLost`.
`ExecutorClient` implements executor_connection.py's `ExecutorConnection`,
the interface the engine depends on.
"""

from __future__ import annotations

import uuid

import grpc

from pagedserve.executor.v1 import executor_pb2 as pb
from pagedserve.executor.v1 import executor_pb2_grpc as pb_grpc
from scheduler_svc.executor_connection import ExecutorInfo, ExecutorLost, ExecutorRefused
from shared.step_codec import plan_to_proto, result_from_proto
from shared.step_plan import StepPlan, StepResult

# Handshake failures that mean "not reachable (yet)"; any other code is a refusal.
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


class ExecutorClient:
    """The gRPC `ExecutorConnection`."""

    def __init__(self, address: str, auth_token: str):
        self._address = address
        # One id per scheduler process: the executor lets the same scheduler reconnect at once
        # and refuses a different one while this one holds it.
        self.scheduler_id = uuid.uuid4().hex
        # The executor refuses every call without its secret (shared/executor_secret.py).
        self._metadata = (("authorization", f"Bearer {auth_token}"),)
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.ExecutorStub | None = None
        self._call = None

    async def connect(
        self, block_size: int, max_num_batched_tokens: int, max_num_seqs: int, timeout_s: float = 5.0
    ) -> ExecutorInfo:
        """Handshakes and opens the Step stream; raises ExecutorLost if unreachable."""
        await self.close()
        self._channel = grpc.aio.insecure_channel(
            self._address,
            options=[
                ("grpc.max_receive_message_length", 256 << 20),
                ("grpc.max_send_message_length", 256 << 20),
                ("grpc.keepalive_time_ms", 10_000),
                ("grpc.keepalive_timeout_ms", 5_000),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.max_pings_without_data", 0),
            ],
        )
        self._stub = pb_grpc.ExecutorStub(self._channel)
        try:
            resp = await self._stub.Handshake(
                pb.HandshakeRequest(
                    block_size_tokens=block_size,
                    max_num_batched_tokens=max_num_batched_tokens,
                    max_num_seqs=max_num_seqs,
                    scheduler_id=self.scheduler_id,
                ),
                timeout=timeout_s,
                metadata=self._metadata,
                wait_for_ready=True,
            )
        except grpc.aio.AioRpcError as e:
            error = ExecutorLost if e.code() in _UNREACHABLE else ExecutorRefused
            raise error(f"handshake with {self._address} failed: {e.code().name}: {e.details()}") from e
        self._call = self._stub.Step(metadata=self._metadata + (("pagedserve-scheduler-id", self.scheduler_id),))
        m, t = resp.model, resp.tokenizer
        return ExecutorInfo(
            model_name=m.model_name,
            architecture=m.architecture,
            vocab_size=m.vocab_size,
            eos_token_ids=tuple(m.eos_token_ids),
            bos_token_id=m.bos_token_id if m.HasField("bos_token_id") else None,
            max_model_len=m.max_model_len_tokens,
            dtype=m.dtype,
            num_kv_blocks=resp.num_kv_blocks,
            kv_cache_bytes=resp.kv_cache_bytes,
            instance_id=resp.instance_id,
            device=resp.device,
            attention_backend=resp.attention_backend,
            tokenizer_json=t.tokenizer_json,
            chat_template=t.chat_template,
            bos_token=t.bos_token,
            eos_token=t.eos_token,
            add_bos_token=t.add_bos_token,
        )

    async def send(self, plan: StepPlan) -> None:
        """Sends a plan; its result comes from `receive`, results in plan order."""
        if self._call is None:
            raise ExecutorLost("not connected")
        try:
            await self._call.write(plan_to_proto(plan))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:
            raise ExecutorLost(f"step stream to {self._address} broke: {e}") from e

    async def receive(self, plan: StepPlan) -> StepResult:
        """The result of `plan`, the oldest plan sent and not yet answered."""
        if self._call is None:
            raise ExecutorLost("not connected")
        try:
            msg = await self._call.read()
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:
            raise ExecutorLost(f"step stream to {self._address} broke: {e}") from e
        if msg is grpc.aio.EOF:
            raise ExecutorLost(f"executor at {self._address} closed the step stream")
        try:
            result = result_from_proto(msg)
        except ValueError as e:  # a desync too: start over
            raise ExecutorLost(f"executor at {self._address} sent a malformed result: {e}") from e
        if result.step_id != plan.step_id:  # a desync: start over as after a loss
            raise ExecutorLost(f"executor answered step {result.step_id} to plan {plan.step_id}")
        return result

    async def wait_lost(self) -> None:
        """Returns once the connection to the executor has failed or closed."""
        channel = self._channel
        if channel is None:
            return
        bad = (
            grpc.ChannelConnectivity.TRANSIENT_FAILURE,
            grpc.ChannelConnectivity.SHUTDOWN,
            grpc.ChannelConnectivity.IDLE,
        )
        state = channel.get_state()
        while state not in bad:
            await channel.wait_for_state_change(state)
            state = channel.get_state()

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
