"""Transport choice for ``fetch``: pure, so every combination is a row."""

from __future__ import annotations

import pytest

from weightd.client.transports.selection import candidates, side_socket_path


@pytest.mark.parametrize(
    ("target", "path"),
    [
        ("unix:///run/weightd/weightd.sock", "/run/weightd/weightd.sock.local"),
        ("unix:/tmp/w.sock", "/tmp/w.sock.local"),
        ("localhost:7070", None),
        ("127.0.0.1:7070", None),
        ("dns:///host:7070", None),
    ],
)
def test_side_socket_path(target: str, path: str | None) -> None:
    assert side_socket_path(target) == path


SIDE = "/run/w.sock.local"


@pytest.mark.parametrize(
    ("requested", "device", "side", "exists", "order"),
    [
        ("auto", "cpu", SIDE, True, ["shm", "grpc"]),
        ("auto", "cuda", SIDE, True, ["cuda_ipc", "shm", "grpc"]),
        ("auto", "cpu", SIDE, False, ["grpc"]),
        ("auto", "cuda", None, False, ["grpc"]),
        ("auto", "cpu", None, False, ["grpc"]),
        ("grpc", "cpu", SIDE, True, ["grpc"]),
        ("grpc", "cuda", None, False, ["grpc"]),
        ("shm", "cpu", SIDE, True, ["shm"]),
        ("shm", "cuda", SIDE, True, ["shm"]),
        ("cuda_ipc", "cuda", SIDE, True, ["cuda_ipc"]),
    ],
)
def test_candidates(
    requested: str, device: str, side: str | None, exists: bool, order: list[str]
) -> None:
    got, reason = candidates(requested, device, side, exists)
    assert got == order
    assert reason


def test_auto_says_why_it_chose_grpc() -> None:
    _, reason = candidates("auto", "cpu", SIDE, False)
    assert SIDE in reason and "--no-shm" in reason
    _, reason = candidates("auto", "cpu", None, False)
    assert "not a Unix socket" in reason


@pytest.mark.parametrize(
    ("requested", "device", "side", "exists", "error", "needle"),
    [
        ("carrier-pigeon", "cpu", SIDE, True, ValueError, "not one of"),
        ("cuda_ipc", "cpu", SIDE, True, ValueError, "needs a CUDA device"),
        ("shm", "cpu", SIDE, False, LookupError, "no side socket"),
        ("shm", "cpu", None, False, LookupError, "not a Unix socket"),
        ("cuda_ipc", "cuda", None, False, LookupError, "unavailable"),
    ],
)
def test_refusals(
    requested: str, device: str, side: str | None, exists: bool, error: type, needle: str
) -> None:
    with pytest.raises(error, match=needle):
        candidates(requested, device, side, exists)
