"""The Ray cluster's address: which one, and whether a Ray cluster answers there (no Ray import).

`ray.init(address=...)` on an address where nothing listens retries for more than a
minute before it fails, and on a port where something else listens (a stale port after
the head died) it retries for ever; `check_ray_address` answers in seconds, before
training starts. A Ray head's GCS is a gRPC server: it answers the HTTP/2 connection
preface with a SETTINGS frame, which is what the check looks for.
"""

from __future__ import annotations

import os
import socket

#: The port `ray start --head` listens on by default (the GCS server).
DEFAULT_RAY_PORT = 6379

#: The client's HTTP/2 connection preface and an empty SETTINGS frame (RFC 9113, 3.4).
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
#: Frame type of SETTINGS: a gRPC server's first frame.
_SETTINGS = 0x04


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


def _first_frame_type(sock: socket.socket) -> int | None:
    """The type of the first HTTP/2 frame the server sends after our preface (None: none)."""
    sock.sendall(_HTTP2_PREFACE)
    header = b""
    while len(header) < 9:
        chunk = sock.recv(9 - len(header))
        if not chunk:
            return None
        header += chunk
    return header[3]


def check_ray_address(
    address: str, *, origin: str = "--hdp-ray-address", timeout_s: float = 5.0
) -> None:
    """ValueError naming `address` unless a Ray head's GCS answers there within `timeout_s`.

    Checks that a TCP connection opens and that the server speaks gRPC (HTTP/2), as the
    GCS does; with `RAY_USE_TLS` set only the connection is checked.
    """
    host, port = split_address(address, origin)
    hint = f"start one with 'ray start --head --port {port}' on {host} or pass its address"
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            if os.environ.get("RAY_USE_TLS", "0") not in ("0", ""):
                return
            try:
                frame = _first_frame_type(sock)
            except OSError as exc:
                frame = None if not isinstance(exc, TimeoutError) else -1
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else exc.strerror or str(exc)
        raise ValueError(
            f"{origin} {address}: no Ray cluster answers there ({reason}); {hint}"
        ) from None
    if frame != _SETTINGS:
        said = (
            f"no answer within {timeout_s:g} s" if frame == -1 else "an answer in another protocol"
        )
        raise ValueError(
            f"{origin} {address}: something listens there, but not a Ray head's GCS (a gRPC "
            f"greeting got {said}; a stale port after the head stopped?); {hint}"
        )
