"""Network helpers shared by the single controller and the workers."""

from __future__ import annotations

import socket

__all__ = ["find_free_port"]


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it; another process may take it before it is bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
