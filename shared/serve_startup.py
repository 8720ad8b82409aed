"""`pagedserve serve` start-up: waiting until every service serves, then saying where to send requests."""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request

from shared.net import local_address
from shared.process_tree import Tree, say
from shared.serve_flags import SCHEDULER, flag_value

STARTUP_NOTE_S = 15.0  # while starting, a progress line this often


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


def wait_until_serving(
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
    try:
        with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
            return json.load(r)["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError):
        return "MODEL"  # a scheduler with auth tokens answers 401 here


def banner(public: str, openai_base: str | None, routed, scheduler_env) -> None:
    cli = "pagedserve" + (f" --target {local_address(public)}" if local_address(public) != "127.0.0.1:50051" else "")
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
