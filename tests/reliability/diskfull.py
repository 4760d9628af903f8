"""A real full disk for tests: a tiny tmpfs filled up, or a file-size limit.

As root (CI) a ``tmpfs`` of a few hundred KiB is mounted and filled with a filler
file, so writes fail with ENOSPC exactly as on a full disk. Where mounting is not
permitted, the command under test runs with ``RLIMIT_FSIZE`` (and SIGXFSZ ignored),
so its writes past the limit fail with EFBIG: the same code path (a write that
fails part-way), never a skip. ``WEIGHTD_TEST_DISKFULL=rlimit`` forces the fallback.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

#: Runs ``weightd`` with a file-size limit (argv[1]) and SIGXFSZ ignored, so a write past
#: the limit fails with EFBIG instead of killing the process.
_LIMITED = (
    "import resource, runpy, signal, sys\n"
    "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
    "n = int(sys.argv.pop(1))\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))\n"
    "sys.argv[0] = 'weightd'\n"
    "runpy.run_module('weightd.server.cli.main', run_name='__main__')\n"
)


@dataclass
class FullDisk:
    mode: str  # "tmpfs" (ENOSPC) or "rlimit" (EFBIG)
    directory: Path
    limit: int  # rlimit mode: the file-size limit of commands run "full"
    full: bool = False

    @property
    def errors(self) -> tuple[str, ...]:
        """What a failed write says in this mode."""
        return (
            ("No space left on device", "ENOSPC")
            if self.mode == "tmpfs"
            else (
                "File too large",
                "EFBIG",
            )
        )

    def fill(self) -> None:
        """From now on writes fail: the tmpfs is filled up (rlimit: commands get the limit)."""
        self.full = True
        if self.mode != "tmpfs":
            return
        fd = os.open(self.directory / ".filler", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for size in (1 << 16, 4096, 1):  # big blocks, then whatever is left of a page
                with contextlib.suppress(OSError):
                    while True:
                        os.write(fd, b"\0" * size)
            with pytest.raises(OSError) as full:
                os.write(fd, b"\0")
            assert full.value.errno == errno.ENOSPC, full.value
        finally:
            os.close(fd)

    def drain(self) -> None:
        self.full = False
        (self.directory / ".filler").unlink(missing_ok=True)

    def command(self, *args: str) -> list[str]:
        """``weightd ARGS``, under the file-size limit when full in rlimit mode."""
        if self.full and self.mode == "rlimit":
            return [sys.executable, "-c", _LIMITED, str(self.limit), *args]
        return [sys.executable, "-m", "weightd.server.cli.main", *args]

    def files(self) -> list[str]:
        return sorted(p for p in os.listdir(self.directory) if p != ".filler")


def _mount(directory: Path, size: int) -> bool:
    if os.environ.get("WEIGHTD_TEST_DISKFULL") == "rlimit" or os.geteuid() != 0:
        return False
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(directory)],
        capture_output=True,
        text=True,
    )
    return done.returncode == 0


@contextlib.contextmanager
def small_disk(directory: Path, size: int = 1 << 20, limit: int = 1024) -> Iterator[FullDisk]:
    """A directory on a file system that :meth:`FullDisk.fill` makes full."""
    directory.mkdir(parents=True, exist_ok=True)
    mounted = _mount(directory, size)
    try:
        yield FullDisk("tmpfs" if mounted else "rlimit", directory, limit)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(directory)], check=False)


def run(
    disk: FullDisk, args: Sequence[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(disk.command(*args), capture_output=True, text=True, timeout=120, env=env)
