"""Listen/connect addresses: `HOST:PORT`, `[v6]:PORT` or `unix:///path/to.sock`."""

from __future__ import annotations


def validate_address(address: str) -> str:
    """Returns the address unchanged if well formed, else raises ValueError."""
    if address.startswith("unix:"):
        if not address[len("unix:") :].lstrip("/"):
            raise ValueError(f"{address!r}: a unix socket address needs a path (unix:///path)")
        return address
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{address!r}: expected HOST:PORT (port 0-65535) or unix:///path")
    return address


def is_loopback(address: str) -> bool:
    """True for unix sockets and loopback hosts: addresses only this machine reaches."""
    if address.startswith("unix:"):
        return True
    host = address.rpartition(":")[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def join_host_port(host: str, port: int) -> str:
    """HOST:PORT, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def local_address(address: str) -> str:
    """An address this machine can connect to, for one a server binds ("0.0.0.0:9" -> "127.0.0.1:9")."""
    host, _, port = address.rpartition(":")
    return f"127.0.0.1:{port}" if host.strip("[]") in ("0.0.0.0", "::", "") else address
