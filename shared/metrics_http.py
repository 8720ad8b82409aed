"""Serves a Prometheus registry on `HOST:PORT/metrics` (a daemon thread)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server


def serve_metrics(listen: str, registry: CollectorRegistry) -> None:
    host, _, port = listen.rpartition(":")
    start_http_server(int(port), addr=host.strip("[]") or "0.0.0.0", registry=registry)
