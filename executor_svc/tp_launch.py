"""Starting the tensor-parallel ranks, and a follower's life (tensor_parallel.py
describes the protocol between them).

Rank 0 (`launch`) checks the model splits, starts ranks 1..N-1 as child
processes (`follower_main`) and joins the job with them; any follower that
exits unasked takes rank 0 down (`Followers`). A follower (`follow`) then
does what rank 0 relays until rank 0 stops it. This module sits above the
worker (a follower builds one); tensor_parallel.py, below it, does not.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
from typing import NoReturn

import structlog
import torch
import torch.distributed as dist

from executor_svc.config import ExecutorConfig
from executor_svc.machine import resolve_device
from executor_svc.model import check_tensor_parallel
from executor_svc.model_loader import open_checkpoint
from executor_svc.tensor_parallel import DATA_TIMEOUT, STORE_HOST, TPGroup, exit_now, join
from executor_svc.worker import Worker
from shared.gc_startup import freeze_startup_objects
from shared.logging import configure_logging

log = structlog.get_logger(__name__)

_FOLLOWER_MAIN = "import sys; from executor_svc.tp_launch import follower_main; sys.exit(follower_main())"


class Followers:
    """Rank 0's child processes. Any that exits unasked takes rank 0 down with it
    (exit 1), so a broken group never keeps serving."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs = procs
        self.stopping = threading.Event()
        for rank, proc in enumerate(procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), name=f"watch-rank{rank}", daemon=True).start()

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self.stopping.is_set():
            log.error("tensor_parallel_rank_died", rank=rank, pid=proc.pid, returncode=code)
            exit_now(1)

    def stop(self) -> None:
        self.stopping.set()
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def launch(config: ExecutorConfig, device: torch.device) -> TPGroup:
    """Rank 0: checks the model splits, starts ranks 1..N-1 and joins the job with them."""
    size = config.tensor_parallel_size
    checkpoint, _ = open_checkpoint(config.model)
    check_tensor_parallel(checkpoint.config, size)  # before any process starts: one clear error
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"--tensor-parallel-size {size} needs {size} GPUs, found {torch.cuda.device_count()}")
    # The rendezvous store listens on a port the OS picks, so concurrent executors never collide.
    store = dist.TCPStore(STORE_HOST, 0, size, is_master=True, timeout=DATA_TIMEOUT, wait_for_workers=False)
    # Followers need no address and no secret (never on their command line).
    follower_config = dataclasses.replace(
        config, listen="127.0.0.1:0", metrics_listen="", auth_token="", auth_token_file=""
    )
    procs = []
    for rank in range(1, size):
        args = [
            "--rank",
            str(rank),
            "--world-size",
            str(size),
            "--store-port",
            str(store.port),
            "--parent-pid",
            str(os.getpid()),
            "--config",
            json.dumps(dataclasses.asdict(follower_config)),
        ]
        # stdout/stderr inherited: every rank logs to the executor's log.
        procs.append(subprocess.Popen([sys.executable, "-c", _FOLLOWER_MAIN, *args]))
        log.info("tensor_parallel_rank_started", rank=rank, pid=procs[-1].pid)
    followers = Followers(procs)  # watching from here on: a follower that fails to start ends rank 0
    try:
        return join(0, size, store, device, followers)
    except BaseException:
        followers.stop()
        raise


def follow(worker: Worker, tp: TPGroup) -> NoReturn:
    """A follower's life: do what rank 0 relays, until rank 0 stops it."""
    while True:
        message = tp.receive()
        kind = message[0]
        if kind == "configure":
            try:
                worker.configure(*message[1:])
            except ValueError:  # e.g. too little KV memory: rank 0 hit the same and told the scheduler
                log.exception("tensor_parallel_configure_failed", rank=tp.rank)
        elif kind == "step":
            if not worker.configured:
                tp.fatal("a step arrived before a successful configure: the ranks disagree")
            worker.runner.execute(message[1])
        else:
            raise AssertionError(f"rank {tp.rank}: unknown control message {kind!r}")


def follower_main(argv: list[str] | None = None) -> NoReturn:
    p = argparse.ArgumentParser(description="A PagedServe tensor-parallel follower; started by rank 0, never by hand.")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--config", required=True, help="ExecutorConfig as JSON")
    a = p.parse_args(argv)
    _die_with_parent(a.parent_pid)
    # Ctrl-C reaches the whole process group; rank 0 alone decides when followers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = ExecutorConfig(**json.loads(a.config))
    configure_logging(config.log_level, config.log_json, service=f"executor-rank{a.rank}")
    store = dist.TCPStore(STORE_HOST, a.store_port, a.world_size, is_master=False, timeout=DATA_TIMEOUT)
    tp = join(a.rank, a.world_size, store, resolve_device(config.device))
    worker = Worker(config, tp)
    log.info("follower_loaded", rank=a.rank, **freeze_startup_objects())  # a stall of one rank stalls them all
    follow(worker, tp)


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when rank 0 dies, however it dies (Linux; elsewhere the
    control socket closing ends the follower instead)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_DEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # rank 0 died before prctl took effect
        exit_now(1)
