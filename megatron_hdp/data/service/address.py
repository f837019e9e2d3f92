"""The Ray cluster's address: which one, and whether anything answers there (no Ray import).

`ray.init(address=...)` on an address where nothing listens retries for more than a
minute before it fails; `check_ray_address` answers in seconds, before training starts.
"""

from __future__ import annotations

import os
import socket

#: The port `ray start --head` listens on by default (the GCS server).
DEFAULT_RAY_PORT = 6379


def address_origin(value: str | None) -> str:
    """Where the address comes from, for messages: the flag, RAY_ADDRESS or the default."""
    if value:
        return "--hdp-ray-address"
    return "RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else "the default Ray address"


def resolve_ray_address(value: str | None) -> str:
    """`--hdp-ray-address`, else `RAY_ADDRESS`, else port 6379 of this node (HOST:PORT)."""
    return value or os.environ.get("RAY_ADDRESS") or f"127.0.0.1:{DEFAULT_RAY_PORT}"


def split_address(address: str, origin: str = "--hdp-ray-address") -> tuple[str, int]:
    """`(host, port)` of HOST:PORT; ValueError naming the address and its origin otherwise."""
    if "://" in address:
        raise ValueError(
            f"{origin} {address!r}: give the head's GCS address HOST:PORT (as 'ray start "
            "--head' prints it), not a Ray Client URL"
        )
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{origin} {address!r} is not HOST:PORT (e.g. 10.0.0.1:6379)")
    return host, int(port)


def check_ray_address(
    address: str, *, origin: str = "--hdp-ray-address", timeout_s: float = 5.0
) -> None:
    """ValueError naming `address` unless a TCP connection to it opens within `timeout_s`."""
    host, port = split_address(address, origin)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else exc.strerror or str(exc)
        raise ValueError(
            f"{origin} {address}: no Ray cluster answers there ({reason}); start "
            f"one with 'ray start --head --port {port}' on {host} or pass its address"
        ) from None
