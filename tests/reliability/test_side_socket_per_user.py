"""Side-socket slots per user: a member of the daemon's group (``--socket-group-access``)
cannot take every lease slot from the daemon's own engines.

A real daemon out of process, a real second user: a child process that drops to uid
65534 (keeping group 0, the daemon's group here, so the 0660 socket admits it) holds
connections; the kernel's ``SO_PEERCRED`` says who it is, which it cannot forge.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import RunningDaemon, run_daemon
from tests.reliability.load_support import demo_model
from tests.reliability.test_hostile_side_socket import _connect
from weightd.client.transports.selection import side_socket_path

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a second user"),
]
__all__ = ["demo_model"]

MAX_CONNECTIONS = 4
OTHER_UID = 65534

HOLDER = textwrap.dedent(
    """
    import os, socket, sys
    from weightd.common.frames import recv_frame
    from weightd.v1 import local_pb2 as lpb
    os.setgroups([]); os.setgid(0); os.setuid(int(sys.argv[2]))
    held, answers = [], []
    for _ in range(int(sys.argv[3])):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(sys.argv[1])
        hello = lpb.LocalHello.FromString(recv_frame(s)[0])
        answers.append(hello.refused.detail if hello.HasField("refused") else "ok")
        held.append(s)
    print("|".join(answers), flush=True)
    sys.stdin.read()
    """
)


@pytest.fixture(scope="module")
def daemon(demo_model: Path) -> Iterator[RunningDaemon]:
    # Not under pytest's 0700 temporary directory: the other user must reach the socket.
    tmp = Path(tempfile.mkdtemp(prefix="weightd-per-user-"))
    tmp.chmod(0o755)
    extra = ["--socket-group-access", "--side-max-connections", str(MAX_CONNECTIONS)]
    extra += ["--side-request-seconds", "60"]
    try:
        with run_daemon(tmp, [("demo", demo_model)], extra) as d:
            yield d
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_another_user_gets_half_the_slots_and_the_daemons_user_keeps_the_rest(
    daemon: RunningDaemon,
) -> None:
    path = side_socket_path(daemon.target)
    assert path is not None
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, path, str(OTHER_UID), str(MAX_CONNECTIONS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    mine: list[socket.socket] = []
    try:
        assert holder.stdout is not None
        answers = holder.stdout.readline().strip().split("|")
        assert answers[:2] == ["ok", "ok"], (answers, holder.stderr.read() if holder.stderr else "")
        assert all(f"uid {OTHER_UID} holds 2 side-channel" in a for a in answers[2:]), answers
        mine = [_connect(daemon) for _ in range(MAX_CONNECTIONS - 2)]  # the daemon's user
    finally:
        for sock in mine:
            sock.close()
        holder.kill()
        holder.wait(30)
