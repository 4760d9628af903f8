"""The pure checks behind socket directories and lock files (#15 item 5)."""

from __future__ import annotations

import os
import stat

import pytest

from weightd.server.daemon.sockets import dir_problem, lock_problem


def _st(mode: int, uid: int = 1000, nlink: int = 1) -> os.stat_result:
    return os.stat_result((mode, 0, 0, nlink, uid, 0, 0, 0, 0, 0))


@pytest.mark.parametrize(
    ("mode", "uid", "group", "problem"),
    [
        (stat.S_IFDIR | 0o700, 1000, False, None),
        (stat.S_IFDIR | 0o750, 1000, True, None),
        (stat.S_IFDIR | 0o710, 1000, True, None),
        (stat.S_IFDIR | 0o750, 1000, False, "has mode 0750: open to other users"),
        (stat.S_IFDIR | 0o770, 1000, True, "has mode 0770: open to other users"),
        (stat.S_IFDIR | 0o701, 1000, False, "has mode 0701: open to other users"),
        (stat.S_IFDIR | 0o1777, 1000, False, "has mode 1777: open to other users"),
        (stat.S_IFDIR | 0o700, 0, False, "is owned by uid 0, not the daemon's uid 1000"),
        (stat.S_IFREG | 0o700, 1000, False, "is not a directory"),
    ],
)
def test_dir_problem(mode: int, uid: int, group: bool, problem: str | None) -> None:
    assert dir_problem(_st(mode, uid), 1000, group) == problem


@pytest.mark.parametrize(
    ("st", "problem"),
    [
        (_st(stat.S_IFREG | 0o600), None),
        (_st(stat.S_IFREG | 0o600, nlink=2), "has 2 hard links"),
        (_st(stat.S_IFREG | 0o600, uid=0), "is owned by uid 0, not the daemon's uid 1000"),
        (_st(stat.S_IFIFO | 0o600), "is not a regular file"),
        (_st(stat.S_IFCHR | 0o600), "is not a regular file"),
    ],
)
def test_lock_problem(st: os.stat_result, problem: str | None) -> None:
    assert lock_problem(st, 1000) == problem
