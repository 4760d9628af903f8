"""A process's resources as the kernel counts them: fds, threads, RSS, private memory.

Read from ``/proc/<pid>`` (Linux), by the leak checks and the soak report. Private
memory (``Private_Clean + Private_Dirty`` of ``smaps_rollup``) is what the process
holds alone; RSS also counts shared pages (and shared-memory packs it maps).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcUsage:
    fds: int
    threads: int
    rss_bytes: int
    private_bytes: int

    def row(self) -> str:
        return (
            f"fds {self.fds}, threads {self.threads}, RSS {self.rss_bytes / 2**20:.1f} MiB, "
            f"private {self.private_bytes / 2**20:.1f} MiB"
        )


def _kb_fields(path: str) -> dict[str, int]:
    out: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def proc_usage(pid: int) -> ProcUsage:
    """Open descriptors, threads, RSS and private bytes of process ``pid`` now."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    threads = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                threads = int(line.split()[1])
    rollup = _kb_fields(f"/proc/{pid}/smaps_rollup")
    return ProcUsage(
        fds=fds,
        threads=threads,
        rss_bytes=rollup.get("Rss", 0),
        private_bytes=rollup.get("Private_Clean", 0) + rollup.get("Private_Dirty", 0),
    )


def fd_targets(pid: int) -> dict[str, str]:
    """What each open descriptor of ``pid`` is (``readlink`` of ``/proc/<pid>/fd/<n>``)."""
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
    return out
