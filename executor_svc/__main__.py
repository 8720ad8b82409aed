"""`python -m executor_svc`: load the model, serve the internal Executor API."""
from __future__ import annotations

import asyncio
import os
import signal
import sys

import structlog

from executor_svc.config import parse_config
from shared.logging import configure_logging

log = structlog.get_logger("executor_svc")


async def run(config) -> int:
    if config.tensor_parallel_size == 1:
        return await serve_worker(config, None)
    from executor_svc.tensor_parallel import launch
    from executor_svc.worker import resolve_device

    # This process is rank 0: it starts the other ranks, and they end with it.
    tp = launch(config, resolve_device(config.device))
    try:
        return await serve_worker(config, tp)
    finally:
        tp.shutdown()


async def serve_worker(config, tp) -> int:
    from grpc_health.v1 import health_pb2

    from executor_svc.metrics import ExecutorMetrics
    from executor_svc.server import SERVICE_NAME, serve
    from shared.metrics_http import serve_metrics
    from executor_svc.worker import Worker

    worker = Worker(config, tp)
    log.info("model_loaded", model=worker.model_config.model_name, dtype=str(worker.dtype),
             compute_dtype=str(worker.model.compute_dtype), kv_cache_dtype=str(worker.kv_dtype),
             device=worker.device.type, attention_backend=worker.attn_backend.name, packed_gemm=worker.packed_gemm,
             block_weights_mib=round(worker.model.block_panel_bytes() / 2**20, 1),
             tensor_parallel_size=config.tensor_parallel_size)
    metrics = ExecutorMetrics()
    if config.metrics_listen:
        serve_metrics(config.metrics_listen, metrics.registry)
    server, health = await serve(worker, config.listen, metrics, config.auth_token)
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


def set_omp_wait_policy(policy: str, environ=os.environ) -> None:
    """Sets how this process's idle OpenMP threads wait (and the ranks it starts).

    It must happen before torch loads: the OpenMP runtime (libgomp, which MKL
    and our native kernels use too) reads it once, when it loads. By default
    libgomp spins at every barrier for 300,000 pause loops (3.6-4.2 ms here)
    before sleeping. That is fast on cores nobody else wants and a collapse
    when another busy process takes one: the spinning thread burns the time
    slice of the thread it waits for. `brief` spins 10,000 (~0.13 ms): meant
    to outlast most gaps between parallel regions inside a step (tens of µs
    of Python), and short enough to yield soon under contention.
    Measured on this project's 2-core machine (docs/benchmarks.md): with one
    busy process beside it, a 64-decode step took 565-1,151 ms with
    libgomp's default, 347-421 brief, 304-330 passive; quiet, brief matched
    the default, passive was up to 2x slower at one decode.
    """
    assert "torch" not in sys.modules, "the OpenMP wait policy must be set before torch is imported"
    if policy == "default":
        return
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        environ.pop(name, None)
    if policy == "brief":
        environ["GOMP_SPINCOUNT"] = "10000"
    else:
        environ["OMP_WAIT_POLICY"] = policy.upper()


def main(argv=None) -> int:
    config = parse_config(argv)
    configure_logging(config.log_level, config.log_json, service="executor")
    set_omp_wait_policy(config.omp_wait_policy)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(run(config))
    return uvloop.run(run(config))


if __name__ == "__main__":
    sys.exit(main())
