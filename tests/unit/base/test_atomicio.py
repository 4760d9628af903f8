"""Atomic writes: readers see the old file or the whole new one, and nothing is left over.

Failures are raised inside the writer's block (the full-disk cases run for real in
``tests/reliability/test_resources.py``); here every branch of the error mapping.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from weightd.server.base.atomicio import atomic_output, write_atomic
from weightd.server.base.errors import OutputWriteError, StorageFullError


def _listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def test_write_atomic_replaces_whole_with_the_mode(tmp_path: Path) -> None:
    target = tmp_path / "m.json"
    target.write_bytes(b"old")
    write_atomic(str(target), b"new contents", mode=0o600)
    assert target.read_bytes() == b"new contents"
    assert target.stat().st_mode & 0o777 == 0o600
    assert _listing(tmp_path) == ["m.json"]


def test_write_atomic_exclusive_refuses_an_existing_file(tmp_path: Path) -> None:
    target = tmp_path / "key"
    target.write_bytes(b"old")
    with pytest.raises(OutputWriteError, match="already exists"):
        write_atomic(str(target), b"new", exclusive=True)
    assert target.read_bytes() == b"old"
    assert _listing(tmp_path) == ["key"]


def test_atomic_output_publishes_only_on_success(tmp_path: Path) -> None:
    target = tmp_path / "rank.safetensors"
    target.write_bytes(b"old")
    with atomic_output(str(target), mode=0o640) as tmp:
        Path(tmp).write_bytes(b"partial")
        assert target.read_bytes() == b"old"  # not visible before the block ends
        Path(tmp).write_bytes(b"whole")
    assert target.read_bytes() == b"whole"
    assert target.stat().st_mode & 0o777 == 0o640
    assert _listing(tmp_path) == ["rank.safetensors"]


class FakeRustError(Exception):
    """Like safetensors' ``SafetensorError``: not an OSError, the errno only in the text."""


@pytest.mark.parametrize(
    ("raised", "expected", "words"),
    [
        (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), StorageFullError, "ENOSPC"),
        (OSError(errno.EIO, os.strerror(errno.EIO)), OutputWriteError, "EIO"),
        (
            FakeRustError("Error while serializing: I/O error: File too large (os error 27)"),
            StorageFullError,
            "EFBIG",
        ),
    ],
)
def test_atomic_output_maps_write_failures_and_keeps_the_old_file(
    tmp_path: Path, raised: Exception, expected: type[OutputWriteError], words: str
) -> None:
    target = tmp_path / "rank.safetensors"
    target.write_bytes(b"old")
    with pytest.raises(OutputWriteError) as info, atomic_output(str(target)) as tmp:
        Path(tmp).write_bytes(b"half")
        raise raised
    assert type(info.value) is expected
    assert str(target) in str(info.value) and words in str(info.value)
    assert "previous file, if any, is unchanged" in str(info.value)
    assert target.read_bytes() == b"old"
    assert _listing(tmp_path) == ["rank.safetensors"]


def test_atomic_output_lets_other_errors_through_and_cleans_up(tmp_path: Path) -> None:
    target = tmp_path / "out"
    with pytest.raises(ValueError, match="not an I/O problem"), atomic_output(str(target)) as tmp:
        Path(tmp).write_bytes(b"x")
        raise ValueError("not an I/O problem")
    assert _listing(tmp_path) == []


def test_atomic_output_in_a_missing_directory_names_the_target(tmp_path: Path) -> None:
    target = tmp_path / "nope" / "out"
    with (
        pytest.raises(OutputWriteError, match=f"cannot write {target}"),
        atomic_output(str(target)),
    ):
        pass
