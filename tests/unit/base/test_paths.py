"""Names confined to a directory (``weightd.server.base.paths``): what passes, what not.

:class:`ConfinedDir` resolves every name by descriptor; these cases pin what it
follows (links that stay inside the root), what it refuses and with which error
(links out, ``..`` past the root, NUL bytes, FIFOs), and that it leaks no descriptor.
The races it exists for are tested out of process in ``tests/reliability/test_path_swaps.py``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from weightd.server.base.errors import (
    CheckpointError,
    MissingFileError,
    NotRegularFileError,
    OutsideRootError,
    PathEscapeError,
    UnsafePathError,
)
from weightd.server.base.paths import ConfinedDir, check_relative_name, open_confined


@pytest.mark.parametrize(
    "name", ["model.safetensors", "sub/dir/x.safetensors", "a..b.safetensors", "...safetensors"]
)
def test_check_relative_name_accepts_plain_names(name: str) -> None:
    check_relative_name("/models/m", name, what="weight_map['t']")


def test_open_confined_returns_an_open_blocking_descriptor(tmp_path: Path) -> None:
    (tmp_path / "f.bin").write_bytes(b"abcdef")
    opened = open_confined(str(tmp_path), "f.bin")
    try:
        assert opened.stat.st_size == 6
        assert os.pread(opened.fd, 3, 2) == b"cde"
        assert os.get_blocking(opened.fd)
        assert not opened.linked
        assert opened.real_path == str(tmp_path.resolve() / "f.bin")
    finally:
        os.close(opened.fd)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """root/a/b/f ("in"), outside/f ("out"), and links of every kind under root."""
    root = tmp_path / "root"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f").write_bytes(b"in")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "f").write_bytes(b"out")
    (root / "lb").symlink_to("a/b")  # a directory link inside
    (root / "a" / "b" / "up").symlink_to("../b/f")  # a file link inside, via ..
    (root / "abs").symlink_to(root / "a" / "b" / "f")  # absolute, but inside
    (root / "a" / "lo").symlink_to(tmp_path / "outside")  # a directory link out
    (root / "a" / "rel").symlink_to("../../outside/f")  # a relative file link out
    (root / "dev").symlink_to("/dev/zero")
    (root / "loop").symlink_to("loop")
    os.mkfifo(root / "fifo")
    return root


@pytest.mark.parametrize("name", ["a/b/f", "lb/f", "a/b/up", "abs", "./a//b/f"])
def test_names_and_links_inside_the_root_are_read(tree: Path, name: str) -> None:
    with ConfinedDir.open(str(tree)) as d:
        opened = d.open_file(name)
        try:
            assert os.read(opened.fd, 10) == b"in"
            assert opened.real_path == str(tree.resolve() / "a" / "b" / "f")
            assert opened.linked == (name not in ("a/b/f", "./a//b/f"))
        finally:
            os.close(opened.fd)


@pytest.mark.parametrize(
    ("name", "error", "words"),
    [
        ("a/lo/f", PathEscapeError, "outside the model directory"),
        ("a/rel", PathEscapeError, "outside the model directory"),
        ("dev", PathEscapeError, "links to /dev/zero"),
        ("a/../a/b/f", PathEscapeError, "has a '..' component"),
        ("/etc/passwd", PathEscapeError, "is absolute"),
        ("a\x00b", PathEscapeError, "NUL byte"),
        ("", PathEscapeError, "empty"),
        ("fifo", NotRegularFileError, "a FIFO"),
        ("a", NotRegularFileError, "a directory"),
        ("lb", NotRegularFileError, "a directory"),
        ("nope", MissingFileError, "does not exist"),
        ("nope/f", MissingFileError, "does not exist"),
        ("a/b/f/g", UnsafePathError, "is not a directory"),
        ("loop", UnsafePathError, "more than 40 symbolic links"),
    ],
)
def test_what_is_refused_and_how(tree: Path, name: str, error: type, words: str) -> None:
    with ConfinedDir.open(str(tree)) as d, pytest.raises(error) as info:
        d.open_file(name)
    assert type(info.value) is error, info.value
    assert words in str(info.value), str(info.value)
    assert str(info.value).lstrip("'").startswith(str(tree.resolve())), info.value


def test_a_subdir_reaches_only_itself_unless_told(tree: Path) -> None:
    (tree / "a" / "b" / "side").symlink_to("../../other")
    (tree / "other").write_bytes(b"other")
    with ConfinedDir.open(str(tree), escape=OutsideRootError) as top:
        with top.subdir("lb", label="the adapter directory") as sub:
            assert sub.path == str(tree.resolve() / "a" / "b")
            with pytest.raises(OutsideRootError, match="outside the adapter directory"):
                sub.open_file("side")
            opened = sub.open_file("f")
            os.close(opened.fd)
        with top.subdir("a/b", label="the model directory", also=("other",)) as sub:
            opened = sub.open_file("side")
            assert os.read(opened.fd, 10) == b"other"
            os.close(opened.fd)
        for bad in ("a/lo", "."):
            with pytest.raises(OutsideRootError):
                top.subdir(bad, label="x")


def test_the_root_itself(tree: Path, tmp_path: Path) -> None:
    (tmp_path / "alias").symlink_to(tree)  # the operator's own path may be a link
    with ConfinedDir.open(str(tmp_path / "alias")) as d:
        assert d.path == str(tree.resolve())
    with pytest.raises(MissingFileError, match="is not a directory"):
        ConfinedDir.open(str(tmp_path / "missing"))
    with pytest.raises(CheckpointError, match="is not a directory"):
        ConfinedDir.open(str(tree / "a" / "b" / "f"))


def test_no_descriptor_is_leaked(tree: Path) -> None:
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    attempts: list[Callable[[ConfinedDir], object]] = [
        lambda d: os.close(d.open_file("lb/f").fd),
        lambda d: d.open_file("a/lo/f"),
        lambda d: d.open_file("a/rel"),
        lambda d: d.open_file("loop"),
        lambda d: d.subdir("lb", label="x").close(),
        lambda d: d.subdir("a/lo", label="x"),
    ]
    before = fds()
    for attempt in attempts:
        with ConfinedDir.open(str(tree)) as d, contextlib.suppress(CheckpointError):
            attempt(d)
    assert fds() == before
