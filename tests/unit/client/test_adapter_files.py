"""Receiving an adapter version's files: order, bounds and the digest, checked (pure)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from weightd.client.api.adapter_files import _Directory, _Memory, _receive
from weightd.client.base.errors import DataLossError, ResourceExhaustedError
from weightd.common.digests import adapter_digest
from weightd.v1 import weightd_pb2 as pb

CONFIG, WEIGHTS = b'{"r": 8}', bytes(range(256)) * 40


def digest(config: bytes = CONFIG, weights: bytes = WEIGHTS) -> str:
    return adapter_digest(hashlib.sha256(config).hexdigest(), hashlib.sha256(weights).hexdigest())


def stream(
    config: bytes = CONFIG, weights: bytes = WEIGHTS, chunk: int = 4096, claimed: str = ""
) -> list[pb.AdapterFileChunk]:
    out = []
    for file, data in (("adapter_config.json", config), ("adapter_model.safetensors", weights)):
        for offset in range(0, max(len(data), 1), chunk):
            out.append(
                pb.AdapterFileChunk(
                    file=file, size=len(data), offset=offset, data=data[offset : offset + chunk]
                )
            )
    out[0].adapter.CopyFrom(pb.AdapterStatus(name="a", version=3, digest=claimed or digest()))
    return out


def test_memory_and_directory_receive_the_same_bytes(tmp_path: Path) -> None:
    memory = _Memory()
    assert _receive("a", stream(), 1 << 20, memory).version == 3
    assert memory.files["adapter_model.safetensors"] == WEIGHTS
    directory = _Directory(str(tmp_path))
    try:
        _receive("a", stream(), 1 << 20, directory)
    finally:
        directory.close()
    assert (tmp_path / "adapter_model.safetensors").read_bytes() == WEIGHTS
    assert (tmp_path / "adapter_config.json").read_bytes() == CONFIG
    assert os.stat(tmp_path / "adapter_config.json").st_mode & 0o777 == 0o400


def test_a_changed_byte_is_refused() -> None:
    messages = stream()
    messages[3].data = b"\xff" + messages[3].data[1:]
    with pytest.raises(DataLossError, match=r"hash to sha256:.*the daemon verified"):
        _receive("a", messages, 1 << 20, _Memory())


@pytest.mark.parametrize(
    ("edit", "error", "match"),
    [
        (lambda m: m.pop(2), DataLossError, "out of order"),
        (lambda m: m.pop(), DataLossError, "arrived incomplete"),
        (lambda m: m[0].ClearField("adapter"), DataLossError, "did not say which version"),
        (lambda m: setattr(m[1], "file", "../x"), DataLossError, "unknown file"),
        (lambda m: setattr(m[1], "size", 1 << 40), ResourceExhaustedError, "over this client"),
        (lambda m: m.clear(), DataLossError, "sent nothing"),
    ],
)
def test_malformed_streams(edit: object, error: type[Exception], match: str) -> None:
    messages = stream()
    edit(messages)  # type: ignore[operator]
    with pytest.raises(error, match=match):
        _receive("a", messages, 1 << 30, _Memory())
