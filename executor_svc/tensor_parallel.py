"""Tensor parallelism on one host: rank 0 serves, ranks 1..N-1 follow.

`python -m executor_svc --tensor-parallel-size N` is rank 0. It spawns ranks
1..N-1 (followers: no server), and all N join one torch.distributed job. Each
rank holds 1/N of every layer (model.py) and of the KV heads (kv_cache.py), and
all of them run every forward pass together. The scheduler still talks to rank
0 only, which relays what it hears on a control group:

    rank 0 (gRPC)                                  rank r > 0 (`follow`)
    Handshake ─ send(("configure", ...)) ────────► worker.configure(...)
                min_over_ranks(KV budget) ◄──────► same: all allocate as many blocks
    Step ────── send(("step", plan)) ────────────► runner.execute(plan)
                agreed(prepare)           ◄──────► same: one fails -> all drop the step
                forward: all_reduce ×2 per layer on the data group
                send_tokens(sampled) ────────────► receive_tokens: append the same tokens
    SIGTERM ─── SIGTERM to each follower

Two process groups: the data group (the default one; gloo on CPU, NCCL on
CUDA) carries the all-reduces inside a step, with a timeout that catches a hung
rank. The control group (always gloo, CPU objects) carries plans and sampled
tokens; followers wait on it for as long as the server idles, so it never times
out. Plans cross by pickle (`broadcast_object_list`: a size, then the bytes, two
collectives per step): simple, and cheap next to a forward pass, but a shared
memory ring like vLLM's would be the next step.

Failure model: collectives either complete on every rank or the process exits
non-zero (`fatal`). A step that fails before the forward pass (a plan that does
not fit the request state) fails on every rank alike and is reported to the
scheduler as usual. A rank that fails inside the forward pass cannot tell how
far the others got, so it exits; when any follower exits, rank 0 exits
non-zero too, and the scheduler recomputes its requests on a restarted
executor. A follower also dies with rank 0 (PR_SET_DEATHSIG, and its control
socket closing).

This module is the collective primitive (`TPGroup`, `join`): it knows
nothing of workers or models. Starting the ranks and a follower's life
(`launch`, `follow`, `follower_main`) sit above the worker, in tp_launch.py.
"""

from __future__ import annotations

import contextlib
import os
import sys
from datetime import timedelta
from typing import TYPE_CHECKING, NoReturn

import structlog
import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from executor_svc.tp_launch import Followers

log = structlog.get_logger(__name__)

# A collective inside a step that waits this long means a rank hung.
DATA_TIMEOUT = timedelta(minutes=10)
# Followers wait on the control group between steps: as long as the server idles.
CONTROL_TIMEOUT = timedelta(days=365)
STORE_HOST = "127.0.0.1"  # one host; across hosts this becomes rank 0's address (docs/scaling.md)


class TPGroup:
    """This process's place in the tensor-parallel job, and the messages between ranks."""

    def __init__(self, rank: int, size: int, device: torch.device, followers: Followers | None = None):
        self.rank, self.size, self.device = rank, size, device
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        self._followers = followers

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    # -- control messages (rank 0 -> all) --------------------------------------------

    def send(self, message: tuple) -> None:
        assert self.is_driver, f"rank {self.rank} tried to send a control message"
        self._control(dist.broadcast_object_list, [message], src=0)

    def receive(self) -> tuple:
        box = [None]
        self._control(dist.broadcast_object_list, box, src=0)
        return box[0]

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        self._control(dist.all_reduce, t, op=dist.ReduceOp.MIN)
        return int(t)

    @contextlib.contextmanager
    def agreed(self, what: str):
        """Runs the block on every rank; if it raised on any rank, it raises on all."""
        try:
            yield
        except Exception:
            self.min_over_ranks(0)
            raise
        if not self.min_over_ranks(1):
            raise RuntimeError(f"another tensor-parallel rank failed {what} (see its log)")

    def send_tokens(self, tokens: list[int] | None, count: int) -> None:
        """Rank 0: this step's `count` sampled tokens, or None when sampling failed."""
        assert tokens is None or len(tokens) == count, f"{len(tokens)} tokens for {count} sampled rows"
        buf = torch.zeros(count + 1, dtype=torch.int64)  # [ok, token...]
        if tokens is not None:
            buf[0] = 1
            buf[1:] = torch.tensor(tokens, dtype=torch.int64)
        self._control(dist.broadcast, buf, src=0)

    def receive_tokens(self, count: int) -> list[int]:
        buf = torch.zeros(count + 1, dtype=torch.int64)
        self._control(dist.broadcast, buf, src=0)
        if not buf[0]:
            raise RuntimeError("rank 0 failed to sample this step")
        return buf[1:].tolist()

    def _control(self, collective, *args, **kwargs) -> None:
        try:
            collective(*args, group=self.control, **kwargs)
        except Exception:
            self.fatal("the control channel between ranks broke")

    # -- failure and shutdown ----------------------------------------------------------

    @contextlib.contextmanager
    def fatal_on_error(self, what: str):
        """Ranks that may be mid-collective cannot be resynchronised: any error here ends the process."""
        try:
            yield
        except Exception:
            self.fatal(f"{what} failed")

    def fatal(self, reason: str) -> NoReturn:
        if self._followers is not None and self._followers.stopping.is_set():
            # Shutting down: followers vanishing mid-step is expected; let the step fail normally.
            raise RuntimeError(f"tensor-parallel rank {self.rank}: {reason} during shutdown")
        log.error("tensor_parallel_fatal", rank=self.rank, reason=reason, exc_info=sys.exc_info()[0] is not None)
        exit_now(1)

    def shutdown(self) -> None:
        """Rank 0: stops every follower (they hold nothing worth saving)."""
        assert self._followers is not None, f"rank {self.rank} owns no followers to shut down"
        self._followers.stop()


def exit_now(code: int) -> NoReturn:
    # os._exit: a thread stuck in a collective would block a normal exit forever.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def join(rank: int, size: int, store: dist.Store, device: torch.device, followers: Followers | None = None) -> TPGroup:
    """Joins the job through rank 0's `store`; returns once all `size` ranks have."""
    if device.type == "cuda":
        device = torch.device("cuda", rank)  # one host: rank r drives GPU r
        torch.cuda.set_device(device)
    if sys.platform == "linux":
        # One host: keep the ranks' sockets on loopback (gloo otherwise binds to
        # whatever the hostname resolves to, and plans arrive pickled). An
        # operator's own choice wins.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=DATA_TIMEOUT)
    return TPGroup(rank, size, device, followers)
