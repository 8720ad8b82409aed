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

Which flag and variable reaches which service: serve_flags.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.cli_config import EnvArgumentParser
from shared.config_fields import check_options, config_from, option, parser_for
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

STARTUP_NOTE_S = 15.0  # while starting, a progress line this often


def say(text: str) -> None:
    print(f"[pagedserve] {text}", file=sys.stderr, flush=True)


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


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _local(address: str) -> str:
    """An address this machine can connect to, for one a server binds ("0.0.0.0:9" -> "127.0.0.1:9")."""
    host, _, port = address.rpartition(":")
    return f"127.0.0.1:{port}" if host.strip("[]") in ("0.0.0.0", "::", "") else address


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the launcher dies, however it dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Tree:
    """The child processes, started and stopped in order."""

    def __init__(self):
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, args: list[str], env: Mapping[str, str]) -> None:
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", name, *args], env=dict(env), process_group=0, preexec_fn=_die_with_parent
        )
        say(f"started {name} (pid {self.procs[name].pid})")

    def exited(self) -> str | None:
        return next((name for name, p in self.procs.items() if p.poll() is not None), None)

    def stop(self, timeout_s: float) -> int:
        """SIGTERM the front (gateway, scheduler: they drain) and then the executor; the worst exit code."""
        worst = 0
        for wave in ((GATEWAY, SCHEDULER), (EXECUTOR,)):
            names = [n for n in wave if n in self.procs]
            for name in names:
                if self.procs[name].poll() is None:
                    self.procs[name].send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for name in names:
                p = self.procs[name]
                try:
                    code = p.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    say(f"{name} did not stop within {timeout_s:.0f} s; killing it")
                    p.kill()
                    code = p.wait()
                # uvicorn re-raises the SIGTERM it handled once it has shut down: that is a clean stop too.
                if code not in (0, -signal.SIGTERM):
                    say(f"{name} exited with code {code}")
                    worst = worst or code
        return worst


def _scheduler_serving(target: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
        except grpc.RpcError:
            return False
    return status == health_pb2.HealthCheckResponse.SERVING


def _gateway_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


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
    public = _host_port(opts.host, opts.port)
    openai = _host_port(opts.host, opts.openai_port) if opts.openai else None
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
            upstream = ",".join(_local(m) for m in (scheduler_metrics, executor_metrics) if m)
            tree.start(
                GATEWAY,
                ["--listen", openai, "--scheduler", _local(public), "--metrics-upstream", upstream, *routed[GATEWAY]],
                environ,
            )
        code = _wait_until_serving(
            tree, _local(public), openai and "http://" + _local(openai), opts.startup_timeout_s, stopping
        )
        if code is None:
            _banner(public, openai and "http://" + _local(openai), routed, scheduler_env)
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


def _wait_until_serving(
    tree: Tree, target: str, gateway_url: str | None, timeout_s: float, stopping: list
) -> int | None:
    """None once every service serves; else the exit code for a failed start (0 if asked to stop)."""
    started = last_note = time.monotonic()
    stage = "model loading"
    while not stopping:
        crashed = tree.exited()
        if crashed:
            say(f"{crashed} exited with code {tree.procs[crashed].returncode} during start-up; see its log above")
            return 1
        if stage == "model loading" and _scheduler_serving(target):
            say(f"scheduler SERVING after {time.monotonic() - started:.1f} s")
            stage = "gateway"
        if stage == "gateway" and (gateway_url is None or _gateway_ready(gateway_url)):
            return None
        now = time.monotonic()
        if now - started > timeout_s:
            say(f"not serving after {timeout_s:.0f} s (--startup-timeout); stopping")
            return 1
        if now - last_note >= STARTUP_NOTE_S:
            say(f"still starting ({stage}, {now - started:.0f} s)")
            last_note = now
        time.sleep(0.25)
    return 0


def _served_model(base: str) -> str:
    import json

    try:
        with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
            return json.load(r)["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError):
        return "MODEL"  # a scheduler with auth tokens answers 401 here


def _banner(public: str, openai_base: str | None, routed, scheduler_env) -> None:
    cli = "pagedserve" + (f" --target {_local(public)}" if _local(public) != "127.0.0.1:50051" else "")
    auth = (
        flag_value(routed[SCHEDULER], "--auth-token")
        or flag_value(routed[SCHEDULER], "--auth-tokens-file")
        or "PAGEDSERVE_AUTH_TOKEN" in scheduler_env
        or "PAGEDSERVE_AUTH_TOKENS_FILE" in scheduler_env
    )
    if auth:
        cli += " --token YOUR_TOKEN"
    lines = [
        f"PagedServe is serving. gRPC API on {public}; try:",
        "",
        f'  {cli} generate --chat "What is a KV cache, in one sentence?"',
        f"  {cli} status",
        "",
    ]
    if openai_base:
        json_body = json.dumps(
            {"model": _served_model(openai_base), "messages": [{"role": "user", "content": "Hello"}]}
        )
        lines += [
            f"OpenAI-compatible API on {openai_base}/v1 (Prometheus metrics on {openai_base}/metrics); try:",
            "",
            f"  curl -s {openai_base}/v1/chat/completions -H 'content-type: application/json' \\"
            + ("\n    -H 'authorization: Bearer YOUR_TOKEN' \\" if auth else ""),
            f"    -d '{json_body}'",
            "",
        ]
    lines.append("Ctrl-C stops everything.")
    print("\n" + "\n".join(lines) + "\n", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
