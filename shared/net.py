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
