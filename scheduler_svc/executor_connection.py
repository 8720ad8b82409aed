"""The executor connection the engine depends on: an interface, its data and its errors.

`executor_client.ExecutorClient` is the real one (gRPC); tests put fakes in
its place (tests/test_step_failure.py). Nothing here knows about protobuf or
grpc, so a fake needs neither.

Results come back in the order plans were sent; the engine may send the next
plan before it receives the previous result (overlap scheduling), so at most
two plans are in flight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from shared.step_plan import StepPlan, StepResult


class ExecutorLost(ConnectionError):
    """The executor cannot be reached or its stream broke; its KV state is gone."""


class ExecutorRefused(ExecutorLost):
    """The executor answered the handshake with a refusal (another scheduler holds
    it, a bad token, a different model than before): worth an operator's look,
    since waiting alone may not help."""


@dataclass(frozen=True)
class ExecutorInfo:
    model_name: str
    architecture: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    max_model_len: int
    dtype: str
    num_kv_blocks: int
    kv_cache_bytes: int
    instance_id: str
    device: str
    attention_backend: str
    tokenizer_json: str
    chat_template: str
    bos_token: str
    eos_token: str
    add_bos_token: bool


@runtime_checkable
class ExecutorConnection(Protocol):
    async def connect(
        self, block_size: int, max_num_batched_tokens: int, max_num_seqs: int, timeout_s: float = 5.0
    ) -> ExecutorInfo:
        """Handshakes (the executor sizes its KV cache for these limits) and opens
        the step stream, dropping any earlier one; raises ExecutorLost if
        unreachable, ExecutorRefused if refused."""

    async def send(self, plan: StepPlan) -> None:
        """Sends a plan; its result comes from `receive`. Raises ExecutorLost."""

    async def receive(self, plan: StepPlan) -> StepResult:
        """The result of `plan`, the oldest plan sent and not yet answered. Raises ExecutorLost."""

    async def wait_lost(self) -> None:
        """Returns once the connection has failed or closed (watched while idle)."""

    async def close(self) -> None:
        """Closes the stream and the connection; connect() may follow."""
