"""Socket directories and lock files an attacker on the host prepared (#15 item 5).

Out of process: a real ``weightd serve`` pointed at a directory someone else could
write, at a lock file planted as a symlink or hard link to a victim file, or started
with umask 000. Before, the daemon used the directory as found, truncated the victim
file to its pid through the planted link, and left ``weightd.sock`` and ``admin.sock``
mode 0777. Each refusal is bounded in time; a daemon that does not refuse is killed.
"""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.conftest import run_daemon, weightd_command
from tests.reliability.load_support import demo_model
from weightd.client import WeightClient

pytestmark = pytest.mark.e2e
__all__ = ["demo_model"]

#: Long enough to load the demo model on a busy machine; a refusal comes far sooner.
REFUSAL_SECONDS = 60


def _refused(model: Path, sock: Path, extra: Sequence[str] = ()) -> str:
    """Run ``serve`` on ``sock``; it must exit 1 at once. Its output."""
    args = ["serve", "--model", f"demo={model}", "--listen", f"unix://{sock}", *extra]
    proc = subprocess.Popen(
        weightd_command(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out, _ = proc.communicate(timeout=REFUSAL_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the daemon served instead of refusing:\n{out}")
    assert proc.returncode == 1, out
    return out


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702], ids=oct)
def test_a_socket_directory_others_can_write_is_refused(
    demo_model: Path, tmp_path: Path, mode: int
) -> None:
    """Writable by others and not sticky: they could rename the socket away. (Sticky
    ones, like /tmp, get a private directory inside: tests/e2e/test_addresses.py.)"""
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(mode)
    out = _refused(demo_model, run / "weightd.sock")
    assert f"socket directory {run} has mode {mode:04o}: other users could replace" in out
    assert "chmod" not in out
    assert sorted(os.listdir(run)) == []  # no lock, no socket: nothing was used
    assert stat.S_IMODE(run.stat().st_mode) == mode  # and nothing was "repaired"


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another uid needs root")
def test_a_socket_directory_owned_by_another_user_is_refused(
    demo_model: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    os.chown(run, 65534, 65534)
    out = _refused(demo_model, run / "weightd.sock")
    assert f"socket directory {run} is owned by uid 65534, not the daemon's uid 0" in out


def test_a_symlinked_socket_directory_is_refused(demo_model: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "run").symlink_to(elsewhere)
    out = _refused(demo_model, tmp_path / "run" / "weightd.sock")
    assert f"socket directory {tmp_path / 'run'} is a symlink; refusing to use it" in out
    assert os.listdir(elsewhere) == []


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_planted_lock_file_never_touches_its_target(
    demo_model: Path, tmp_path: Path, link: str
) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    lock = run / "weightd.sock.lock"
    if link == "symlink":
        lock.symlink_to(victim)
        why = "is a symlink"
    else:
        os.link(victim, lock)
        why = "has 2 hard links"
    out = _refused(demo_model, run / "weightd.sock")
    assert f"lock file {lock} {why}; refusing to use it" in out
    assert victim.read_text() == "precious\n"
    assert not (run / "weightd.sock").exists()


def test_with_umask_000_every_socket_is_0600_in_a_0700_directory(
    demo_model: Path, tmp_path: Path
) -> None:
    """The directory the daemon creates and each socket it binds get their mode from
    the daemon, not from the umask it was started with."""
    old = os.umask(0)  # inherited by the daemon's process (run_daemon has no preexec)
    try:
        with run_daemon(tmp_path, [("demo", demo_model)]) as daemon:
            os.umask(old)
            run = tmp_path / "run"
            modes = {p.name: stat.S_IMODE(p.lstat().st_mode) for p in run.iterdir()}
            assert stat.S_IMODE(run.stat().st_mode) == 0o700
            with WeightClient(daemon.target, timeout=60) as client:
                assert client.list_models()
    finally:
        os.umask(old)
    assert modes == {
        "weightd.sock": 0o600,
        "weightd.sock.local": 0o600,
        "admin.sock": 0o600,
        "admin.sock.local": 0o600,  # the trainer's publish from memory
        "weightd.sock.lock": 0o600,
        "admin.sock.lock": 0o600,
    }, {k: f"{v:04o}" for k, v in modes.items()}


def test_group_access_makes_worker_sockets_0660_and_keeps_admin_0600(
    demo_model: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o750)  # accepted only because group access was asked for
    run.chmod(0o750)
    with run_daemon(tmp_path, [("demo", demo_model)], ["--socket-group-access"]) as daemon:
        modes = {p.name: stat.S_IMODE(p.lstat().st_mode) for p in run.iterdir()}
        with WeightClient(daemon.target, timeout=60) as client:
            assert client.list_models()
    assert stat.S_IMODE(run.stat().st_mode) == 0o750
    assert modes["weightd.sock"] == 0o660
    assert modes["weightd.sock.local"] == 0o660
    assert modes["admin.sock"] == 0o600  # admin is never shared with the group
    assert modes["admin.sock.local"] == 0o600  # nor is its side socket (publish from memory)
    # Without the flag the group may search the directory but not connect: the socket
    # is 0600, and the directory is used as it is only under a umask that keeps the
    # group out until then; under one that does not, the socket goes in a private one.
    from weightd.server.daemon.sockets import PRIVATE, USE, dir_plan

    st = run.stat()
    assert dir_plan(st, os.geteuid(), False, 0o022)[0] == USE
    assert dir_plan(st, os.geteuid(), False, 0o002)[0] == PRIVATE
