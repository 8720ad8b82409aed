"""`pagedserve serve [MODEL]`: executor, scheduler and OpenAI gateway as one process tree.

    pagedserve serve                                # the embedded model; gRPC :50051, OpenAI :8000
    pagedserve serve Qwen/Qwen2.5-0.5B-Instruct --openai-port 8080 --max-num-seqs 64
    pagedserve serve model.gguf --no-openai --port 6000

The executor listens on a Unix socket in a private (0700) temporary folder, so
only this tree can drive it, and every call to it carries this installation's
executor secret, which both find on their own (shared/executor_secret.py). Any other flag of a service passes through to
the service that has it (serve_flags.py); `--log-level` etc. reach all that have
it. Start-up prints each stage and then where to send requests. Ctrl-C or
SIGTERM stops the gateway and the scheduler first (they drain open requests),
then the executor, and exits 0; the children die with this process even if it
is killed (PR_SET_PDEATHSIG), and they run in their own process group so that
a terminal's Ctrl-C reaches only this process, which stops them in order.

Which flag and variable reaches which service: serve_flags.py; the children
and their stop order: process_tree.py; readiness waits and the banner:
serve_startup.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.cli_config import EnvArgumentParser
from shared.config_fields import check_options, config_from, option, parser_for
from shared.net import join_host_port, local_address
from shared.process_tree import Tree, say
from shared.serve_flags import (
    EXECUTOR,
    GATEWAY,
    SCHEDULER,
    child_envs,
    flag_value,
    routes,
    service_parsers,
    split_args,
)
from shared.serve_startup import banner, wait_until_serving


@dataclass(frozen=True)
class ServeOptions:
    """The launcher's own flags; every other flag belongs to a service (serve_flags.py)."""

    model: str | None = None  # the MODEL argument; None: the embedded model
    host: str = option("127.0.0.1", help="Address the public ports bind to (0.0.0.0: all interfaces).")
    port: int = option(50051, help="The gRPC API's port (the scheduler).")
    openai_port: int = option(8000, help="The OpenAI-compatible HTTP API's port.")
    openai: bool = option(True, flag="--no-openai", help="Do not start the OpenAI gateway.")
    executor_metrics_listen: str = option("", help="HOST:PORT for the executor's own /metrics.")
    startup_timeout_s: float = option(1800.0, help="Seconds to wait for SERVING (downloads count).")

    def __post_init__(self) -> None:
        check_options(self)


def parser(environ: Mapping[str, str]) -> EnvArgumentParser:
    p = parser_for(
        ServeOptions,
        environ,
        prog="pagedserve serve",
        description="Start the executor, the scheduler and the OpenAI gateway as one process tree. Every other flag "
        "of `python -m executor_svc`, `python -m scheduler_svc` or `python -m openai_gateway` passes through "
        "to the service(s) that have it.",
    )
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="A .gguf file, a Hugging Face folder or id (org/name); default: the embedded SmolLM2-135M.",
    )
    return p


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    environ = dict(os.environ if environ is None else environ)
    p = parser(environ)
    parsers = service_parsers(environ)
    mine, extra = split_args(list(sys.argv[1:] if argv is None else argv), p, parsers)
    args = p.parse_args(mine)
    opts = config_from(ServeOptions, p, args, model=args.model)
    try:
        routed = routes(extra, parsers)
    except ValueError as e:
        p.error(str(e))
    if flag_value(routed[SCHEDULER], "--tls-cert") or environ.get("PAGEDSERVE_TLS_CERT"):
        # The launcher's readiness probe and the gateway speak plaintext to the scheduler.
        p.error(
            "TLS on the gRPC port is not supported by pagedserve serve; start the services one by one "
            "(python -m scheduler_svc --tls-cert ..., python -m openai_gateway --scheduler-tls-ca ...)"
        )
    executor_env, scheduler_env = child_envs(environ)
    private = tempfile.mkdtemp(prefix="pagedserve-")  # mode 0700: only this user reaches the socket
    executor = f"unix://{private}/executor.sock"
    public = join_host_port(opts.host, opts.port)
    openai = join_host_port(opts.host, opts.openai_port) if opts.openai else None
    # The scheduler's (and executor's) metrics reach users through the gateway's /metrics:
    # on loopback ports of their own unless the user chose addresses.
    scheduler_metrics = (
        flag_value(routed[SCHEDULER], "--metrics-listen")
        or scheduler_env.get("PAGEDSERVE_METRICS_LISTEN")
        or (f"127.0.0.1:{_free_port()}" if openai else "")
    )
    executor_metrics = opts.executor_metrics_listen or (f"127.0.0.1:{_free_port()}" if openai else "")
    tree = Tree()
    stopping: list[int] = []

    def on_signal(signum, _frame):
        stopping.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        say(f"loading {opts.model or 'the embedded SmolLM2-135M-Instruct'} in the executor ({executor})")
        tree.start(
            EXECUTOR,
            [
                *(["--model", opts.model] if opts.model else []),
                "--listen",
                executor,
                *(["--metrics-listen", executor_metrics] if executor_metrics else []),
                *routed[EXECUTOR],
            ],
            executor_env,
        )
        sched_args = ["--listen", public, "--executor", executor, *routed[SCHEDULER]]
        if scheduler_metrics and "--metrics-listen" not in routed[SCHEDULER]:
            sched_args += ["--metrics-listen", scheduler_metrics]
        tree.start(SCHEDULER, sched_args, scheduler_env)
        if openai:
            upstream = ",".join(local_address(m) for m in (scheduler_metrics, executor_metrics) if m)
            tree.start(
                GATEWAY,
                [
                    "--listen",
                    openai,
                    "--scheduler",
                    local_address(public),
                    "--metrics-upstream",
                    upstream,
                    *routed[GATEWAY],
                ],
                environ,
            )
        code = wait_until_serving(
            tree, local_address(public), openai and "http://" + local_address(openai), opts.startup_timeout_s, stopping
        )
        if code is None:
            banner(public, openai and "http://" + local_address(openai), routed, scheduler_env)
            while not stopping and tree.exited() is None:
                time.sleep(0.2)
            crashed = tree.exited() if not stopping else None
            if crashed:
                say(f"{crashed} exited with code {tree.procs[crashed].returncode}; stopping the others")
            code = 1 if crashed else 0
        say("stopping")
        stopped = tree.stop(timeout_s=_drain_s(routed) + 15)
        return code or (1 if stopped else 0)  # a child that did not stop cleanly is worth a non-zero exit
    finally:
        for proc in tree.procs.values():
            if proc.poll() is None:
                proc.kill()
        shutil.rmtree(private, ignore_errors=True)


def _drain_s(routed: Mapping[str, list[str]]) -> float:
    value = flag_value(routed[SCHEDULER], "--drain-timeout")
    return float(value) if value else 30.0


if __name__ == "__main__":
    sys.exit(main())
