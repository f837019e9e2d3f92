"""The Ray address pre-check: a Ray head's GCS answers, anything else is named in seconds."""

import socket
import threading
import time
from concurrent import futures

import pytest

from megatron_hdp.data.service.address import check_ray_address


@pytest.fixture
def listener():
    """A TCP port that accepts connections; `answer` (bytes or None: silence) is sent back."""
    sockets = []

    def serve(answer: bytes | None) -> int:
        server = socket.create_server(("127.0.0.1", 0))
        sockets.append(server)

        def loop():
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:
                    return
                sockets.append(conn)
                conn.recv(64)
                if answer is not None:
                    conn.sendall(answer)
                    conn.close()

        threading.Thread(target=loop, daemon=True).start()
        return server.getsockname()[1]

    yield serve
    for s in sockets:
        s.close()


def test_a_grpc_server_passes_as_a_ray_head_does():
    grpc = pytest.importorskip("grpc")  # Ray's own dependency: the GCS is a gRPC server
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        check_ray_address(f"127.0.0.1:{port}", timeout_s=5)
    finally:
        server.stop(None)


@pytest.mark.parametrize(
    "answer, said",
    [
        (None, "a gRPC greeting got no answer within 1 s"),
        (b"HTTP/1.1 400 Bad Request\r\n\r\n", "a gRPC greeting got an answer in another protocol"),
        (b"", "a gRPC greeting got an answer in another protocol"),
    ],
    ids=["silent", "http", "closes"],
)
def test_a_port_where_something_else_listens_is_named_in_seconds(listener, answer, said):
    """Before: only a TCP connection was checked, then `ray.init` retried for ever."""
    port = listener(answer)
    started = time.monotonic()
    with pytest.raises(ValueError) as info:
        check_ray_address(f"127.0.0.1:{port}", timeout_s=1)
    assert time.monotonic() - started < 5
    assert str(info.value).startswith(
        f"--hdp-ray-address 127.0.0.1:{port}: something listens there, but not a Ray head's "
        f"GCS ({said}; a stale port after the head stopped?); start one with 'ray start --head "
        f"--port {port}' on 127.0.0.1 or pass its address"
    )


def test_a_join_that_hangs_is_given_up_naming_the_address(monkeypatch):
    """`ray.init` itself is bounded too (a head that accepts but never lets the rank in)."""
    ray = pytest.importorskip("ray")
    from megatron_hdp.data.service import client
    from megatron_hdp.errors import DataServiceError

    release = threading.Event()
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: release.wait(30))
    started = time.monotonic()
    with pytest.raises(DataServiceError, match="the Ray cluster at 10.0.0.9:6379 did not let"):
        client._init("10.0.0.9:6379", timeout_s=0.5)
    release.set()
    assert time.monotonic() - started < 5
