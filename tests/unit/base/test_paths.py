"""File names confined to a model directory (``weightd.server.base.paths``): what passes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from weightd.server.base.paths import check_relative_name, open_regular_file


@pytest.mark.parametrize(
    "name", ["model.safetensors", "sub/dir/x.safetensors", "a..b.safetensors", "...safetensors"]
)
def test_check_relative_name_accepts_plain_names(name: str) -> None:
    check_relative_name("/models/m", name, what="weight_map['t']")


def test_open_regular_file_returns_an_open_descriptor(tmp_path: Path) -> None:
    (tmp_path / "f.bin").write_bytes(b"abcdef")
    fd, st = open_regular_file(str(tmp_path), "f.bin")
    try:
        assert st.st_size == 6
        assert os.pread(fd, 3, 2) == b"cde"
        assert os.get_blocking(fd)
    finally:
        os.close(fd)
