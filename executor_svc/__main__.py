"""`python -m executor_svc`: load the model, serve the internal Executor API."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
import time

import structlog

from executor_svc.config import parse_config
from executor_svc.heap import keep_freed_memory, release_free_memory
from shared.logging import configure_logging

log = structlog.get_logger("executor_svc")


async def run(config) -> int:
    from executor_svc.model_source import ModelNotFound, resolve_model

    try:
        path = resolve_model(config.model, config.revision)
    except ModelNotFound as e:
        log.error("model_not_found", error=str(e))
        return 1
    # Ranks and loaders see the local path from here on.
    config = dataclasses.replace(config, model=path, revision=None)
    if config.tensor_parallel_size == 1:
        return await serve_worker(config, None)
    from executor_svc.machine import resolve_device
    from executor_svc.tp_launch import launch

    # This process is rank 0: it starts the other ranks, and they end with it.
    tp = launch(config, resolve_device(config.device))
    try:
        return await serve_worker(config, tp)
    finally:
        tp.shutdown()


async def serve_worker(config, tp) -> int:
    from grpc_health.v1 import health_pb2

    from executor_svc import weight_packing
    from executor_svc.metrics import ExecutorMetrics
    from executor_svc.model_loader import default_model_path
    from executor_svc.server import SERVICE_NAME, forward_thread, serve
    from executor_svc.worker import Worker
    from shared.gc_startup import freeze_startup_objects
    from shared.metrics_http import serve_metrics
    from shared.model_id import model_id

    path = config.model
    started = time.monotonic()
    forward = forward_thread()
    try:
        path = path or default_model_path()
        log.info("model_loading", path=path, size_gib=round(_size_bytes(path) / 2**30, 2))
        worker = await asyncio.get_running_loop().run_in_executor(forward, Worker, config, tp)
    except ValueError as e:  # a model or setting this executor cannot serve: the message says which
        log.error("model_load_failed", path=path, error=str(e))
        return 1
    frozen = freeze_startup_objects()  # its gc.collect frees the load's cyclic garbage first
    release_free_memory()  # the load's temporaries, which keep_freed_memory's thresholds would keep
    log.info(
        "model_loaded",
        model=worker.model_config.model_name,
        load_s=round(time.monotonic() - started, 2),
        dtype=str(worker.dtype),
        compute_dtype=str(worker.model.compute_dtype),
        kv_cache_dtype=str(worker.kv_dtype),
        device=worker.device.type,
        attention_backend=worker.attn_backend.name,
        packed_gemm=worker.packed_gemm,
        deterministic=config.deterministic,
        block_weights_mib=round(weight_packing.block_panel_bytes(worker.model) / 2**20, 1),
        tensor_parallel_size=config.tensor_parallel_size,
        **frozen,
    )
    metrics = ExecutorMetrics(config.metrics_prefix, model_id(worker.model_config.model_name))
    if config.metrics_listen:
        serve_metrics(config.metrics_listen, metrics.registry)
    server, health = await serve(worker, config.listen, metrics, config.auth_token, forward)
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("executor_serving", listen=config.listen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("executor_stopping")
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace=2.0)
    return 0


def _size_bytes(path: str) -> int:
    """Bytes on disk of a model file or folder (what loading reads)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(
        os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if os.path.isfile(os.path.join(path, f))
    )


def set_omp_wait_policy(policy: str, environ=os.environ) -> None:
    """Sets how this process's idle OpenMP threads wait (and the ranks it starts).

    It must happen before torch loads: the OpenMP runtime (libgomp, which MKL
    and our native kernels use too) reads OMP_WAIT_POLICY once, when it
    loads. By default libgomp spins at every barrier for 300,000 pause loops
    (3.6-4.2 ms here) before sleeping: fastest on cores nobody else wants, and
    a collapse when another busy process takes one, since the spinning thread
    burns the time slice of the thread it waits for. `passive` sleeps at once.
    Measured on this project's 2-core machine (`python -m bench.omp_wait`,
    docs/optimization_log.md): beside one busy process a 64-decode step took 507 ms
    with the default and 307-318 passive; on free cores passive was slower
    (one decode 37-46 vs 30 ms) and so was the headline run (0.88x, 0.82x).
    """
    assert "torch" not in sys.modules, "the OpenMP wait policy must be set before torch is imported"
    if policy != "default":
        environ["OMP_WAIT_POLICY"] = policy.upper()


def main(argv=None) -> int:
    config = parse_config(argv)
    configure_logging(config.log_level, config.log_json, service="executor")
    keep_freed_memory()  # before any thread starts: the forward thread must share the main arena
    set_omp_wait_policy(config.omp_wait_policy)
    try:
        import uvloop

        loop_run = uvloop.run
    except ImportError:
        loop_run = asyncio.run
    try:
        return loop_run(run(config))
    except KeyboardInterrupt:
        # Ctrl-C before serving began (once serving, SIGINT stops it cleanly): the model is
        # loading on the forward thread, which cannot be interrupted and which a normal exit
        # would wait for. Nothing is held yet that needs more than the OS's cleanup.
        log.info("executor_interrupted_while_loading")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)


if __name__ == "__main__":
    sys.exit(main())
