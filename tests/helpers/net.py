"""Network helpers for tests: a free TCP port."""

from __future__ import annotations

import socket


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the kernel's pick for a bind to port 0)."""
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])
