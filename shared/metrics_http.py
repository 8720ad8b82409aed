"""Serves a Prometheus registry on `HOST:PORT/metrics` (a daemon thread); metric naming."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, start_http_server


def validate_metrics_prefix(prefix: str) -> str:
    """`pagedserve` (default) or e.g. `vllm`, so that dashboards built for vLLM's names work unchanged."""
    if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", prefix):
        raise ValueError(f"{prefix!r}: expected a Prometheus name such as pagedserve or vllm")
    return prefix


def serve_metrics(listen: str, registry: CollectorRegistry) -> None:
    host, _, port = listen.rpartition(":")
    start_http_server(int(port), addr=host.strip("[]") or "0.0.0.0", registry=registry)
