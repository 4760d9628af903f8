"""Directories swapped for symlinks while the daemon reads them (#15 item 2).

Out of process: a real daemon, and a racer process (``swapper``) that swaps a
directory for a symlink to one outside, as fast as it can, while the test asks the
daemon to read it — ``LoadAdapter`` from under ``--adapter-root``, ``Reload`` of a
model whose shards sit in a subdirectory. Bounded: at most ``ATTEMPTS`` calls or
``SECONDS`` each. Before, the root check resolved a path string and the files were
then opened by path again, so the outside adapter was published (9 of 400 attempts)
or the call answered INTERNAL (``realpath``'s EINVAL). Now every file is opened by
descriptor under the root (``base/paths.py``): what was verified is what is read, and
the outside bytes are never published, whatever the race; a call that loses the race
is refused with a code that says so, never INTERNAL.

Requests naming a path that is no plain path (NUL byte, ``..``, outside every root)
are refused with INVALID_ARGUMENT or PERMISSION_DENIED, naming the path.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import grpc
import pytest
import torch
from safetensors.torch import load_file

from tests.adapters.conftest import BASE_CONFIG, Fixture, expected, same_bytes
from tests.conftest import RunningDaemon, run_daemon
from tests.models import build_model
from weightd.client import AdminClient, WeightClient
from weightd.client.base.errors import WeightdError
from weightd.server.adapters.load import CONFIG_FILE, WEIGHTS_FILE, adapter_digest

pytestmark = pytest.mark.e2e

ATTEMPTS = 200
SECONDS = 60.0
#: What losing the race may answer: the directory was missing for a moment, or a link
#: out of the root was met and refused. Never INTERNAL, never UNKNOWN.
REFUSALS = {
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
}
#: Up to this many seconds of the real directory in place between swaps in a race's
#: second half (a tiny model's reload takes milliseconds here, tens under load).
DWELL = 0.2


@contextlib.contextmanager
def racing(path: Path, outside: Path, dwell: float = 0.0) -> Iterator[subprocess.Popen[str]]:
    """Run the swapper on ``path`` (-> ``outside``) for the duration of the block.

    ``dwell``: the swapper's random pause (up to that many seconds) with the real
    directory in place after each round; 0 swaps in a tight loop.
    """
    swapper = "tests.reliability.swapper"
    racer = subprocess.Popen(
        [sys.executable, "-m", swapper, str(path), str(outside), "120", str(dwell)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert racer.stdout is not None
        assert racer.stdout.readline().strip() == "ready"
        yield racer
    finally:
        racer.terminate()
        out, _ = racer.communicate(timeout=30)
    assert racer.returncode == 0, out
    assert int(out.split()[-1]) > 0  # it did swap
    assert path.is_dir() and not path.is_symlink()  # and put the real directory back


T = TypeVar("T")


@dataclass
class RaceResult(Generic[T]):
    won: list[T]  # what each call that won the race returned
    refused: dict[str, int]  # status code name -> how many calls lost it


def race(path: Path, outside: Path, call: Callable[[], T]) -> RaceResult[T]:
    """Make ``call`` against the swapper, half the attempts in each of two phases.

    Against the tight loop a call that opens the directory several times (a reload
    opens every shard) loses almost every time on a loaded machine (CI saw 200 of 200
    refused); with random gaps between the swaps it mostly wins. Both phases, so both
    outcomes are exercised whatever the machine's load. A lost call must be refused
    with one of ``REFUSALS``, never INTERNAL (or UNKNOWN).
    """
    result: RaceResult[T] = RaceResult([], {})
    for dwell in (0.0, DWELL):
        with racing(path, outside, dwell=dwell):
            deadline = time.monotonic() + SECONDS / 2
            for _ in range(ATTEMPTS // 2):
                if time.monotonic() > deadline:
                    break
                try:
                    result.won.append(call())
                except WeightdError as exc:
                    assert exc.code in REFUSALS, exc
                    result.refused[exc.code.name] = result.refused.get(exc.code.name, 0) + 1
    print(f"race on {path.name}: {len(result.won)} won, refused {result.refused}")  # with -s
    assert result.won, f"no call won the race at all: {result.refused}"
    assert result.refused, f"the race never made a call meet the link ({len(result.won)} won)"
    return result


def _open_fds(daemon: RunningDaemon) -> int:
    return len(os.listdir(f"/proc/{daemon.process.pid}/fd"))


def _shard_fds(daemon: RunningDaemon) -> int:
    """The daemon's descriptors on ``.safetensors`` files (one per shard a version holds)."""
    fd_dir = f"/proc/{daemon.process.pid}/fd"
    links = []
    for fd in os.listdir(fd_dir):
        with contextlib.suppress(OSError):  # closed since listed
            links.append(os.readlink(f"{fd_dir}/{fd}"))
    return sum(link.endswith(".safetensors") for link in links)


#: Descriptors the daemon may hold more after a race than before it (gRPC's own come and
#: go); a walk that leaked on its error paths would leak one or more per lost call.
FD_SLACK = 16


def _digest_of(directory: Path) -> str:
    def sha(name: str) -> str:
        return hashlib.sha256((directory / name).read_bytes()).hexdigest()

    return adapter_digest(sha(CONFIG_FILE), sha(WEIGHTS_FILE))


@dataclass
class AdapterDaemon:
    daemon: RunningDaemon
    root: Path  # its --adapter-root, holding "victim" (a copy of the good adapter)
    admin_target: str


@pytest.fixture(scope="module")
def adapter_daemon(
    lora: Fixture, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AdapterDaemon]:
    tmp = tmp_path_factory.mktemp("path-swaps")
    root = tmp / "adapters"
    root.mkdir()
    shutil.copytree(lora.adapter_dir, root / "victim")
    (root / "escape").symlink_to("/etc")
    with run_daemon(tmp, [("tiny-llama", lora.base_dir)], ["--adapter-root", str(root)]) as d:
        yield AdapterDaemon(d, root, f"unix://{tmp / 'run' / 'admin.sock'}")


def test_adapter_dir_swapped_for_a_link_out_is_never_published(
    lora: Fixture, adapter_daemon: AdapterDaemon, tmp_path: Path
) -> None:
    daemon, root = adapter_daemon.daemon, adapter_daemon.root
    victim = root / "victim"
    outside = tmp_path / "outside" / "victim"  # another good adapter for the same base
    shutil.copytree(lora.second_dir, outside)
    inside, other = _digest_of(victim), _digest_of(outside)
    assert inside != other
    with AdminClient(adapter_daemon.admin_target, timeout=60) as admin:
        assert admin.load_adapter("victim", str(victim)).digest == inside
        fds = _open_fds(daemon)
        result = race(victim, outside, lambda: admin.load_adapter("victim", str(victim)).digest)
        assert other not in result.won, f"the outside adapter was published: {result.refused}"
        assert set(result.won) == {inside}
        assert _open_fds(daemon) <= fds + FD_SLACK
        [status] = [s for s in admin.list_adapters() if s.name == "victim"]
        assert (status.digest, status.source_dir) == (inside, str(victim.resolve()))
    config = json.loads((lora.base_dir / "config.json").read_text())
    with WeightClient(daemon.target, timeout=60) as client:
        got = client.fetch_adapter("victim", 1, 2)
    assert got.digest == inside
    assert same_bytes(dict(got.tensors), expected(victim, 2, 1, config))


def _model_in_a_subdirectory(directory: Path, seed: int) -> Path:
    """A tiny Llama whose shards live in ``directory/w/``, named so by its index."""
    build_model("llama", BASE_CONFIG, seed=seed).save_pretrained(
        str(directory), max_shard_size="150KB"
    )
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    (directory / "w").mkdir()
    for shard in set(index["weight_map"].values()):
        os.rename(directory / shard, directory / "w" / shard)
    index["weight_map"] = {t: f"w/{s}" for t, s in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    assert len(set(index["weight_map"].values())) >= 2
    return directory


def test_model_subdir_swapped_for_a_link_out_during_reload_is_never_published(
    tmp_path: Path,
) -> None:
    model = _model_in_a_subdirectory(tmp_path / "model", seed=1)
    outside = _model_in_a_subdirectory(tmp_path / "outside", seed=2)  # same layout, other bytes
    inside_tensors = {
        n: t for f in sorted((model / "w").iterdir()) for n, t in load_file(str(f)).items()
    }
    with run_daemon(tmp_path, [("m", model)]) as daemon:
        admin = AdminClient(f"unix://{tmp_path / 'run' / 'admin.sock'}", timeout=60)
        client = WeightClient(daemon.target, timeout=60)
        try:
            digests = {t.name: t.digest for t in client.describe("m").tensors}
            shards = _shard_fds(daemon)
            assert shards == len(list((model / "w").iterdir()))

            def reload() -> dict[str, str]:
                admin.reload("m")
                return {t.name: t.digest for t in client.describe("m").tensors}

            result = race(model / "w", outside / "w", reload)
            assert all(now == digests for now in result.won), "outside bytes were published"
            # A won reload replaces the version before it, a lost one leaves garbage
            # naming the served one: neither may keep descriptors open (it left 5-8
            # old versions' shards open before the registry collected that garbage).
            assert _shard_fds(daemon) == shards
            got = client.fetch(0, 1)
            assert got.keys() == inside_tensors.keys()
            assert all(torch.equal(got[n], inside_tensors[n]) for n in got)
        finally:
            client.close()
            admin.close()


@pytest.mark.parametrize(
    ("source", "code", "words"),
    [
        ("{root}/vic\x00tim", grpc.StatusCode.INVALID_ARGUMENT, "contains a NUL byte"),
        ("{root}/../adapters/victim", grpc.StatusCode.INVALID_ARGUMENT, "has a '..' component"),
        ("{root}/victim/..", grpc.StatusCode.INVALID_ARGUMENT, "has a '..' component"),
        ("/etc", grpc.StatusCode.PERMISSION_DENIED, "outside the adapter roots"),
        ("{root}", grpc.StatusCode.PERMISSION_DENIED, "adapter root itself"),
        ("{root}/escape", grpc.StatusCode.PERMISSION_DENIED, "outside the adapter root"),
    ],
)
def test_request_paths_that_are_not_plain_paths_are_refused(
    adapter_daemon: AdapterDaemon, source: str, code: grpc.StatusCode, words: str
) -> None:
    path = source.format(root=adapter_daemon.root)
    with AdminClient(adapter_daemon.admin_target, timeout=60) as admin:
        with pytest.raises(WeightdError) as info:
            admin.load_adapter("x", path)
        assert "x" not in [s.name for s in admin.list_adapters()]
    assert info.value.code == code, info.value
    assert words in info.value.detail, info.value.detail
