"""`python -m scheduler_svc`: the public API in front of one executor. Torch-free."""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import structlog

from scheduler_svc.config import parse_config
from shared.logging import configure_logging

log = structlog.get_logger("scheduler_svc")
STARTUP_NOTICE_S = 30.0  # while the executor is unreachable at start-up, an INFO line this often


def _server_credentials(config):
    import grpc

    if not config.tls_cert:
        return None
    with open(config.tls_key, "rb") as f:
        key = f.read()
    with open(config.tls_cert, "rb") as f:
        cert = f.read()
    ca = None
    if config.tls_client_ca:
        with open(config.tls_client_ca, "rb") as f:
            ca = f.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


async def run(config) -> int:
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    from pagedserve.v1 import generation_pb2_grpc as pb_grpc
    from scheduler_svc.engine import Engine
    from scheduler_svc.executor_client import ExecutorClient, ExecutorLost, ExecutorRefused
    from scheduler_svc.server import SERVICE_NAME, GenerationServicer
    from scheduler_svc.stats_logger import StatsLogger
    from scheduler_svc.text_work import TextWorkers
    from shared.gc_startup import freeze_startup_objects
    from shared.grpc_auth import BearerAuthInterceptor, TokenTable
    from shared.grpc_codec import CodecInterceptor

    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", int(config.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.so_reuseport", 0),
    ]
    if config.max_connection_age_s > 0:
        options += [
            ("grpc.max_connection_age_ms", int(config.max_connection_age_s * 1000)),
            ("grpc.max_connection_age_grace_ms", int(config.drain_timeout_s * 1000)),
        ]
    tokens = TokenTable(config.auth_tokens, config.admin_tokens) if config.auth_tokens else None
    # Authentication first: a refused call's message is never parsed.
    interceptors = ([BearerAuthInterceptor(tokens)] if tokens else []) + [CodecInterceptor()]
    server = grpc.aio.server(interceptors=interceptors, options=options)
    engine = Engine(config, ExecutorClient(config.executor, config.executor_auth_token))
    workers = TextWorkers()
    pb_grpc.add_GenerationServicer_to_server(GenerationServicer(engine, config, tokens, workers), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, "grpc.health.v1.Health", reflection.SERVICE_NAME), server)
    creds = _server_credentials(config)
    bound = server.add_secure_port(config.listen, creds) if creds else server.add_insecure_port(config.listen)
    if bound == 0 and not config.listen.startswith("unix:"):
        raise OSError(f"could not listen on {config.listen}")
    await server.start()
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, not_serving)

    def on_connection(connected: bool) -> None:
        if not engine.draining:
            for name in ("", SERVICE_NAME):
                asyncio.ensure_future(health_servicer.set(name, serving if connected else not_serving))

    engine.on_connection_change(on_connection)
    if config.metrics_listen:
        from shared.metrics_http import serve_metrics

        serve_metrics(config.metrics_listen, engine.metrics.registry)
        log.info("metrics_listening", listen=config.metrics_listen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("scheduler_listening", listen=config.listen, executor=config.executor)
    waited_since = time.monotonic()
    while not stop.is_set():
        try:
            await engine.connect()
            break
        except ExecutorLost as e:
            # Not up yet is normal at start-up (the executor loads its model): DEBUG, with a
            # reminder at INFO every STARTUP_NOTICE_S. A refusal (another scheduler holds it,
            # a bad token) is not normal.
            if isinstance(e, ExecutorRefused):
                log.warning("waiting_for_executor", error=str(e))
            else:
                waited = time.monotonic() - waited_since
                log.debug("waiting_for_executor", error=str(e))
                if waited >= STARTUP_NOTICE_S:
                    log.info("still_waiting_for_executor", executor=config.executor, waited_s=round(waited))
                    waited_since = time.monotonic()
            await asyncio.wait([asyncio.ensure_future(stop.wait())], timeout=1.0)
    if engine.connected:  # start-up is over: the tokenizer and the executor's handshake are in
        log.info("startup_objects_frozen", **freeze_startup_objects())
    loop_task = asyncio.ensure_future(engine.run()) if engine.scheduler is not None else None
    stats_task = None
    if engine.scheduler is not None and config.log_stats_interval_s > 0:
        stats_task = asyncio.ensure_future(StatsLogger(engine, config.log_stats_interval_s).run())
    crashed: list[BaseException] = []

    def on_loop_done(task: asyncio.Task) -> None:
        # The step loop only ends by cancellation. If it died, no request can
        # progress: say so loudly and shut down, rather than hang while SERVING.
        if not task.cancelled() and task.exception() is not None:
            crashed.append(task.exception())
            log.error("step_loop_crashed", exc_info=task.exception())
            stop.set()

    if loop_task is not None:
        loop_task.add_done_callback(on_loop_done)
    await stop.wait()
    drain_s = 0.0 if crashed else config.drain_timeout_s
    log.info("draining", timeout_s=drain_s)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, not_serving)
    if engine.scheduler is not None:
        await engine.drain(drain_s)
    await server.stop(grace=1.0)
    for task in (loop_task, stats_task):
        if task is not None:
            task.cancel()
    await engine.client.close()
    workers.close()
    log.info("stopped")
    return 1 if crashed else 0


def main(argv=None) -> int:
    config = parse_config(argv)
    configure_logging(config.log_level, config.log_json, service="scheduler")
    try:
        import uvloop
    except ImportError:
        return asyncio.run(run(config))
    return uvloop.run(run(config))


if __name__ == "__main__":
    sys.exit(main())
