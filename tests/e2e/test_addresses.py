"""One address rule for every entry point, and socket directories (issue #39, point 3).

The rule is pure (``weightd.common.addresses``) and tested by a table; then each entry
point is driven out of process with every form: ``weightd serve --listen``, the CLI
commands (positional, ``--target``, none: the default socket), ``WeightClient``,
``AdminClient`` and the vLLM loader's ``target``. Socket directories: a shared one
(sticky, like /tmp) gets a private ``weightd-UID`` directory, found by clients given
the first path; a plain ``mkdir`` (0755) directory of the user's is used as it is; the
rest is refused in one line that never advises changing a directory's mode.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import weightd_command
from tests.health import wait_serving
from weightd.common.addresses import Address, AddressError, parse_address
from weightd.server.cli.demo import ensure_demo_checkpoint
from weightd.server.daemon.sockets import PRIVATE, REFUSE, USE, dir_plan

pytestmark = pytest.mark.e2e


# --- the rule, pure ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/run/x.sock", Address("unix", path="/run/x.sock")),
        ("./my.sock", Address("unix", path="/w/my.sock")),
        ("my.sock", Address("unix", path="/w/my.sock")),
        ("run/w.sock", Address("unix", path="/w/run/w.sock")),
        ("../up.sock", Address("unix", path="/up.sock")),
        ("unix:///run/x.sock", Address("unix", path="/run/x.sock")),
        ("unix://my.sock", Address("unix", path="/w/my.sock")),
        ("unix:my.sock", Address("unix", path="/w/my.sock")),
        ("unix:/run/x.sock", Address("unix", path="/run/x.sock")),
        ("  /run/x.sock ", Address("unix", path="/run/x.sock")),
        ("localhost:7070", Address("tcp", host="localhost", port=7070)),
        ("10.0.0.1:7070", Address("tcp", host="10.0.0.1", port=7070)),
        ("[::1]:7070", Address("tcp", host="::1", port=7070)),
        (":7070", Address("tcp", host="127.0.0.1", port=7070)),
        ("dns:///host:7070", Address("grpc", target="dns:///host:7070")),
        ("unix-abstract:weightd", Address("grpc", target="unix-abstract:weightd")),
    ],
)
def test_the_address_rule(text: str, expected: Address) -> None:
    assert parse_address(text, cwd="/w") == expected


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "empty address"),
        ("localhost", "neither a socket path nor HOST:PORT"),
        ("host:port", "port 'port' is not 0-65535"),
        ("host:70000", "is not 0-65535"),
        ("http://host:7070", "scheme 'http' is not one weightd uses"),
        ("unix://", "names no socket path"),
    ],
)
def test_addresses_outside_the_rule_are_one_error_listing_the_forms(text: str, needle: str) -> None:
    with pytest.raises(AddressError) as info:
        parse_address(text, cwd="/w")
    assert needle in str(info.value) and "HOST:PORT" in str(info.value)


def test_grpc_targets_and_loopback() -> None:
    assert parse_address("[::1]:7").grpc_target == "[::1]:7"
    assert parse_address("/a.sock").grpc_target == "unix:///a.sock"
    assert parse_address("[::1]:7").is_loopback and parse_address("/a.sock").is_loopback
    assert not parse_address("10.0.0.1:7").is_loopback
    assert not parse_address("dns:///h:7").is_loopback


# --- socket directories, pure -------------------------------------------------------------


def _st(mode: int, uid: int = 1000) -> os.stat_result:
    return os.stat_result((stat.S_IFDIR | mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))


@pytest.mark.parametrize(
    ("mode", "owner", "group", "umask", "plan"),
    [
        (0o700, 1000, False, 0o022, USE),
        (0o750, 1000, True, 0o002, USE),
        (0o755, 1000, False, 0o022, USE),  # plain mkdir: others cannot write or connect
        (0o755, 1000, False, 0o002, PRIVATE),  # group could connect before the chmod
        (0o755, 1000, True, 0o002, USE),  # ... but group access was asked for
        (0o755, 1000, False, None, PRIVATE),  # umask unknown: assume the worst
        (0o711, 1000, False, 0o077, USE),
        (0o1777, 0, False, 0o022, PRIVATE),  # /tmp
        (0o1777, 1000, False, 0o022, PRIVATE),
        (0o1770, 0, True, 0o022, PRIVATE),  # a group's shared directory
        (0o777, 1000, False, 0o022, REFUSE),  # others may rename our entries
        (0o775, 1000, False, 0o022, REFUSE),
        (0o755, 0, False, 0o022, REFUSE),  # someone else's (root's /run)
        (0o700, 1001, False, 0o022, REFUSE),
    ],
)
def test_dir_plan(mode: int, owner: int, group: bool, umask: int | None, plan: str) -> None:
    got, why = dir_plan(_st(mode, owner), 1000, group, umask)
    assert got == plan, why
    assert "chmod" not in why and "make it" not in why


# --- every entry point, out of process ------------------------------------------------------


@contextlib.contextmanager
def _serve(
    tmp: Path, args: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None
) -> Iterator[tuple[str, str]]:
    """``weightd serve ARGS`` on the demo checkpoint; (worker, admin) addresses it logged."""
    from tests.conftest import listening_address

    log_path = tmp / f"daemon-{len(list(tmp.glob('daemon-*.log')))}.log"
    environment = dict(env or os.environ, WEIGHTD_CACHE_DIR=str(DEMO_CACHE))
    demo = ensure_demo_checkpoint(str(DEMO_CACHE))
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            weightd_command("serve", "--model", demo, *args),
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=cwd,
            env=environment,
        )
    try:
        worker = admin = None
        for _ in range(600):
            text = log_path.read_text()
            worker, admin = listening_address(text, "worker"), listening_address(text, "admin")
            if worker or process.poll() is not None:
                break
            import time

            time.sleep(0.1)
        assert worker is not None and admin is not None, log_path.read_text()
        wait_serving(worker, process, log_path)
        yield worker, admin
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)


DEMO_CACHE = Path(os.environ.get("TMPDIR", "/tmp")) / f"weightd-addr-demo-{os.getuid()}"


def _weightd(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        weightd_command(*args), capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done.stdout


_CLIENTS = textwrap.dedent(
    """
    import json, sys
    from weightd.client import AdminClient, WeightClient
    from weightd.vllm.loader.options import parse_options
    out = {}
    for form in json.loads(sys.argv[1]):
        with WeightClient(form or None, timeout=30) as c:
            out[form] = [m.name for m in c.list_models()]
        parse_options({"target": form} if form else None)  # the loader's rule
    for form in json.loads(sys.argv[2]):
        with AdminClient(form or None, timeout=60) as a:
            out["admin " + form] = a.reload().model
    print(json.dumps(out))
    """
)


def _clients(
    forms: list[str], admin_forms: list[str], *, cwd: Path, env: dict[str, str] | None = None
) -> dict[str, object]:
    """``WeightClient`` and ``AdminClient`` (and the vLLM loader's option check) given each
    form, in a process of their own (relative forms read its working directory)."""
    done = subprocess.run(
        [sys.executable, "-c", _CLIENTS, json.dumps(forms), json.dumps(admin_forms)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_a_relative_socket_path_everywhere(tmp_path: Path) -> None:
    """``serve --listen ./my.sock`` and every client given the same forms."""
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    with _serve(tmp_path, ["--listen", "./my.sock"], cwd=work) as (worker, admin):
        assert worker == f"unix://{work}/my.sock" and admin == f"unix://{work}/admin.sock"
        forms = ["./my.sock", "my.sock", "unix://my.sock", "unix:my.sock", str(work / "my.sock")]
        forms.append(f"unix://{work}/my.sock")
        got = _clients(forms, ["./admin.sock", "admin.sock"], cwd=work)
        assert all(got[f] == ["llama-demo"] for f in forms), got
        assert got["admin ./admin.sock"] == "llama-demo"
        for form in ("./my.sock", "unix://my.sock", str(work / "my.sock")):
            assert _weightd("list", form, cwd=work).startswith("llama-demo\t")
            assert _weightd("list", "--target", form, cwd=work).startswith("llama-demo\t")
        assert "SERVING" in _weightd("health", "my.sock", cwd=work)
        assert "reloaded llama-demo" in _weightd("reload", "admin.sock", cwd=work)


def test_no_address_is_the_default_socket_everywhere(tmp_path: Path) -> None:
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime))
    with _serve(tmp_path, [], env=env) as (worker, admin):
        assert worker == f"unix://{runtime}/weightd/weightd.sock"
        assert admin == f"unix://{runtime}/weightd/admin.sock"
        got = _clients([""], [""], cwd=tmp_path, env=env)
        assert got[""] == ["llama-demo"] and got["admin "] == "llama-demo"
        assert _weightd("list", env=env).startswith("llama-demo\t")
        assert "llama-demo" in _weightd("describe", env=env)
        assert "SERVING" in _weightd("health", env=env)
        assert "reloaded llama-demo" in _weightd("reload", env=env)
        out = tmp_path / "r0.safetensors"
        line = _weightd("fetch", "--rank", "0", "--world-size", "2", "--out", str(out), env=env)
        assert line.startswith("wrote ") and out.exists()


def test_a_socket_in_a_shared_directory_goes_in_a_private_one(tmp_path: Path) -> None:
    """``--listen unix:///tmp/weightd.sock``: the daemon binds in ``/tmp/weightd-UID``
    (0700, its own), changes nothing about /tmp, and a client given the first path
    finds it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    asked = shared / "weightd.sock"
    private = shared / f"weightd-{os.geteuid()}"
    with _serve(tmp_path, ["--listen", f"unix://{asked}"]) as (worker, admin):
        assert worker == f"unix://{private}/weightd.sock"
        assert admin == f"unix://{private}/admin.sock"
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
        assert stat.S_IMODE(shared.stat().st_mode) == 0o1777  # never repaired in place
        got = _clients([f"unix://{asked}", str(asked)], [], cwd=tmp_path)
        assert got[str(asked)] == ["llama-demo"]
        assert _weightd("list", str(asked)).startswith("llama-demo\t")
        log = "".join(p.read_text() for p in tmp_path.glob("daemon-*.log"))
        assert f"private directory {private}" in log and "chmod" not in log


def test_a_plain_mkdir_directory_is_used_as_it_is(tmp_path: Path) -> None:
    """``mkdir run`` (0755, the user's own): others cannot write it, and the socket is
    0600 from before anyone can connect, so it is accepted and left as it is."""
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o755)
    with _serve(tmp_path, ["--listen", str(run / "w.sock")]) as (worker, _):
        assert worker == f"unix://{run}/w.sock"
        assert stat.S_IMODE((run / "w.sock").stat().st_mode) == 0o600
        assert stat.S_IMODE(run.stat().st_mode) == 0o755


@pytest.mark.parametrize("case", ["world-writable", "someone-elses"])
def test_unsafe_directories_are_refused_in_one_line_without_chmod_advice(
    tmp_path: Path, case: str
) -> None:
    directory = tmp_path / case
    directory.mkdir()
    if case == "world-writable":
        directory.chmod(0o777)
    else:
        if os.geteuid() != 0:
            pytest.skip("making a directory someone else's needs root (CI runs as root)")
        directory.chmod(0o755)
        os.chown(directory, 65534, 65534)
    env = dict(os.environ, WEIGHTD_CACHE_DIR=str(DEMO_CACHE))
    done = subprocess.run(
        weightd_command("serve", "--listen", str(directory / "w.sock")),
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 1
    (line,) = (done.stdout + done.stderr).splitlines()
    assert line.startswith("weightd serve: error: socket directory") and str(directory) in line
    assert "chmod" not in line and "make it" not in line and "unix://" in line
    assert list(directory.iterdir()) == []


def test_wrong_socket_names_the_right_one(tmp_path: Path) -> None:
    """A worker call on the admin socket, an admin call on the worker socket: each is
    the daemon's own typed answer naming the other socket, not "Method not found!"."""
    work = tmp_path / "w"
    work.mkdir(mode=0o700)
    script = textwrap.dedent(
        """
        import sys
        from weightd.client import AdminClient, WeightClient
        from weightd.client.base.errors import AdminOnly, NotWeightd, WorkerOnly
        worker, admin = sys.argv[1], sys.argv[2]
        try:
            WeightClient(admin, timeout=30).list_models()
        except WorkerOnly as e:
            print("worker-on-admin", e.metadata.get("worker"), "|", e)
        try:
            AdminClient(worker, timeout=30).reload()
        except AdminOnly as e:
            print("admin-on-worker", e.metadata.get("admin"), "|", e)
        try:
            WeightClient(worker + ".local", timeout=30).list_models()
        except NotWeightd as e:
            print("side-socket |", e)
        """
    )
    with _serve(tmp_path, ["--listen", str(work / "w.sock")]) as (worker, admin):
        done = subprocess.run(
            [sys.executable, "-c", script, worker, admin],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines[0].startswith(f"worker-on-admin {worker} |") and worker in lines[0]
        assert "Method not found" not in done.stdout
        assert lines[1].startswith(f"admin-on-worker {admin} |")
        assert lines[2].startswith("side-socket |") and f"give {worker}" in lines[2], lines
        cli = subprocess.run(
            weightd_command("list", admin), capture_output=True, text=True, timeout=60
        )
        assert cli.returncode == 1
        (line,) = cli.stderr.splitlines()
        assert "admin listener" in line and worker in line
