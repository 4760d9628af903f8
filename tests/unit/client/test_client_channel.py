"""The client's gRPC channel is made by the first call that needs it, never after close."""

from __future__ import annotations

from pathlib import Path

import pytest

from weightd.client import WeightClient
from weightd.client.base.errors import UnavailableError


def test_no_channel_until_a_grpc_call_needs_one(tmp_path: Path) -> None:
    client = WeightClient(f"unix://{tmp_path}/absent.sock", timeout=5)
    try:
        assert client._grpc is None  # a shared-memory fetch would never open one
        with pytest.raises(UnavailableError):
            client.list_models()  # nobody listens: the call is made, and fails as itself
        assert client._grpc is not None
        channel = client._grpc[0]
        with pytest.raises(UnavailableError):
            client.describe()
        assert client._grpc[0] is channel  # one channel for every call
    finally:
        client.close()


@pytest.mark.parametrize("used_before", [False, True])
def test_calls_after_close_are_refused_without_a_new_channel(
    tmp_path: Path, used_before: bool
) -> None:
    client = WeightClient(f"unix://{tmp_path}/absent.sock", timeout=5)
    if used_before:
        with pytest.raises(UnavailableError):
            client.list_models()
    client.close()
    made = client._grpc
    with pytest.raises(ValueError, match="closed"):
        client.list_models()
    with pytest.raises(ValueError, match="closed"):
        client.fetch(0, 2, transport="grpc")
    with pytest.raises(ValueError, match="closed"):
        client.fetch(0, 2, transport="grpc", streams=2)
    assert client._grpc is made  # nothing was opened again
    client.close()  # closing twice is harmless
