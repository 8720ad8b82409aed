"""The executor's gRPC edge: Handshake and the Step stream.

Protobuf is converted to the step dataclasses here and nowhere deeper. The
forward pass runs on one dedicated thread so the event loop stays free for
health checks and the next plan's decoding; that thread also loads the model
(`forward_thread`, below).

Every call but health must carry the executor's secret (shared/executor_secret.py):
a peer without it is refused UNAUTHENTICATED before any handler runs. Among
the peers that hold it, one scheduler at a time owns the executor (`_claim`);
every handshake drops the request state and zeroes the KV memory
(Worker.configure), so a new owner never reads what an earlier one computed.
"""

from __future__ import annotations

import asyncio
import ctypes
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from executor_svc.metrics import ExecutorMetrics
from executor_svc.worker import Worker
from pagedserve.executor.v1 import executor_pb2 as pb
from pagedserve.executor.v1 import executor_pb2_grpc as pb_grpc
from shared.grpc_auth import BearerAuthInterceptor
from shared.step_codec import plan_from_proto, result_to_proto

log = structlog.get_logger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Executor"].full_name
STREAM_CLOSE_GRACE_S = 2.0  # how long another scheduler's handshake waits for the owner's stream to close
CLAIM_S = 10.0  # how long a handshake holds the executor before its Step stream opens
SCHEDULER_ID_KEY = "pagedserve-scheduler-id"
MAX_SCHEDULER_ID_CHARS = 128  # ids are logged: keep them short
FORWARD_THREAD_NAME = "ps-forward"  # at most 15 bytes (the kernel's limit)


def forward_thread() -> ThreadPoolExecutor:
    """The one thread that builds the Worker and runs its every configure and step.

    One thread, not just one at a time: libgomp (the OpenMP runtime torch and
    the native kernels share) keeps a pool of worker threads for each thread
    that ever ran a parallel region, and once the threads it manages outnumber
    the CPUs it cuts every barrier's spin from 300,000 pause loops to 100, so
    idle workers sleep and need a futex wake at each of a step's hundreds of
    parallel regions. A model loaded on the event loop's thread and stepped on
    this one did exactly that: decode steps 1.26-2.2x slower than on a single
    thread, the cores idle a quarter of the time (docs/optimization_log.md).
    Tasks run in the order they were submitted. On Linux the thread is named
    FORWARD_THREAD_NAME for the OS, and the OpenMP workers it starts inherit
    the name: `top -H` shows them, and a test checks that no other thread spins.
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward", initializer=_name_os_thread)


def _name_os_thread() -> None:
    try:
        ctypes.CDLL(None).prctl(15, FORWARD_THREAD_NAME.encode())  # PR_SET_NAME: this thread only
    except (OSError, AttributeError):  # not Linux: the name is only a convenience
        pass


class ExecutorServicer(pb_grpc.ExecutorServicer):
    def __init__(self, worker: Worker, metrics: ExecutorMetrics, forward: ThreadPoolExecutor):
        self._worker = worker
        self._metrics = metrics
        self._forward_thread = forward  # the thread that built `worker`: the only one that touches its tensors
        self._instance_id = uuid.uuid4().hex
        # The scheduler this executor serves: claimed by a handshake, held while
        # its Step stream is open (or, before that stream opens, for CLAIM_S).
        self._owner = ""  # its scheduler_id
        self._claimed_at = 0.0  # monotonic time of the owner's last handshake
        self._stream_replaced: asyncio.Event | None = None  # set to end the owner's open Step stream
        self._stream_closed = asyncio.Event()  # set whenever no Step stream is open
        self._stream_closed.set()
        self._handshake_lock = asyncio.Lock()  # one handshake at a time: check, claim, configure

    async def Handshake(self, request: pb.HandshakeRequest, context) -> pb.HandshakeResponse:
        if request.block_size_tokens == 0 or request.block_size_tokens > 256:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"block_size_tokens must be 1..256, got {request.block_size_tokens}"
            )
        sid = request.scheduler_id
        if not sid or len(sid) > MAX_SCHEDULER_ID_CHARS or not sid.isprintable():
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"scheduler_id must be 1..{MAX_SCHEDULER_ID_CHARS} printable characters",
            )
        async with self._handshake_lock:
            await self._claim(sid, context)
            loop = asyncio.get_running_loop()
            # Drops all request state and zeroes the KV memory before this owner's first step.
            info = await loop.run_in_executor(
                self._forward_thread,
                self._worker.configure,
                request.block_size_tokens,
                request.max_num_batched_tokens,
                request.max_num_seqs,
            )
        log.info("handshake", scheduler_id=sid, block_size=request.block_size_tokens, num_kv_blocks=info.num_kv_blocks)
        m, t = info.model, info.tokenizer
        return pb.HandshakeResponse(
            model=pb.ModelDescription(
                model_name=m.model_name,
                architecture=m.architecture,
                vocab_size=m.vocab_size,
                eos_token_ids=list(m.eos_token_ids),
                max_model_len_tokens=info.max_model_len,
                dtype=info.dtype_name,
                **({"bos_token_id": m.bos_token_id} if m.bos_token_id is not None else {}),
            ),
            tokenizer=pb.TokenizerInfo(
                tokenizer_json=t.tokenizer_json,
                chat_template=t.chat_template,
                bos_token=t.bos_token,
                eos_token=t.eos_token,
                add_bos_token=t.add_bos_token,
            ),
            num_kv_blocks=info.num_kv_blocks,
            kv_cache_bytes=info.kv_cache_bytes,
            instance_id=self._instance_id,
            device=info.device,
            attention_backend=info.attention_backend,
        )

    async def _claim(self, scheduler_id: str, context) -> None:
        """Makes `scheduler_id` the owner, or aborts the handshake.

        One executor serves one scheduler: a handshake resets the request state
        the owner relies on. The owner's own handshake (a reconnect) replaces
        its old stream at once. Another scheduler waits STREAM_CLOSE_GRACE_S for
        the owner's stream to close and is refused if it does not; an owner
        that died releases it when its connection closes (at once when its
        process ends, within the keepalive, ~40 s, after a partition).
        """
        if scheduler_id == self._owner and self._stream_replaced is not None:
            await self._end_open_stream()
        elif scheduler_id != self._owner and self._owner:
            try:
                await asyncio.wait_for(self._stream_closed.wait(), STREAM_CLOSE_GRACE_S)
            except asyncio.TimeoutError:
                pass
            unopened = self._stream_replaced is None and time.monotonic() - self._claimed_at < CLAIM_S
            if self._stream_replaced is not None or unopened:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "another scheduler is connected to this executor (one executor serves one scheduler)",
                )
            # Worth an operator's look: a restarted scheduler, or someone else holding the secret.
            log.warning(
                "executor_owner_changed",
                previous_scheduler_id=self._owner,
                scheduler_id=scheduler_id,
                kv_cache="zeroed before the new owner's first step",
            )
        self._owner, self._claimed_at = scheduler_id, time.monotonic()

    async def _end_open_stream(self) -> None:
        """Ends the owner's open Step stream (it aborts at its next wait) and waits until it has."""
        self._stream_replaced.set()
        await self._stream_closed.wait()

    async def Step(self, request_iterator, context):
        scheduler_id = dict(context.invocation_metadata()).get(SCHEDULER_ID_KEY, "")
        if not self._worker.configured or not scheduler_id or scheduler_id != self._owner:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "Step needs a handshake from the same scheduler first (one executor serves one scheduler)",
            )
        if self._stream_replaced is not None:  # the owner's old stream is still open: end it first
            await self._end_open_stream()
        replaced = self._stream_replaced = asyncio.Event()
        self._stream_closed.clear()
        loop = asyncio.get_running_loop()
        read = gone = None
        try:
            while True:
                # Wait for the next plan, or for this stream to be replaced by its owner's reconnect.
                read = asyncio.ensure_future(context.read())
                gone = asyncio.ensure_future(replaced.wait())
                await asyncio.wait({read, gone}, return_when=asyncio.FIRST_COMPLETED)
                gone.cancel()
                if replaced.is_set():
                    read.cancel()
                    await context.abort(grpc.StatusCode.ABORTED, "replaced by a newer stream of the same scheduler")
                msg = read.result()
                if msg is grpc.aio.EOF:
                    return
                plan = plan_from_proto(msg)
                result = await loop.run_in_executor(self._forward_thread, self._worker.runner.execute, plan)
                self._metrics.observe(plan, result)
                await context.write(result_to_proto(result))
        finally:
            # On shutdown this handler is cancelled mid-wait: its read then fails with the
            # server. Retrieve that, or asyncio prints "Task exception was never retrieved".
            for task in (read, gone):
                if task is not None:
                    task.cancel()
                    task.add_done_callback(_retrieve)
            if self._stream_replaced is replaced:
                self._stream_replaced = None
                self._claimed_at = 0.0  # the owner keeps its id for a reconnect, not its claim
            self._stream_closed.set()


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


async def serve(
    worker: Worker, listen: str, metrics: ExecutorMetrics, auth_token: str, forward: ThreadPoolExecutor
) -> tuple[grpc.aio.Server, health.HealthServicer]:
    """Serves `worker`, which `forward` built and alone runs, on `listen`; every
    call but health must present `auth_token`."""
    if not auth_token:
        raise ValueError("the executor serves only a scheduler that presents its secret: auth_token is required")
    server = grpc.aio.server(
        interceptors=[BearerAuthInterceptor((auth_token,))],
        options=[
            ("grpc.max_receive_message_length", 256 << 20),
            ("grpc.max_send_message_length", 256 << 20),
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ],
    )
    pb_grpc.add_ExecutorServicer_to_server(ExecutorServicer(worker, metrics, forward), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    if server.add_insecure_port(listen) == 0 and not listen.startswith("unix:"):
        raise OSError(f"could not listen on {listen}")
    await server.start()
    return server, health_servicer
