"""Shards changed under a serving daemon (out of process, ``transformers`` checkpoints).

For each way a file changes — truncated in place, overwritten in place (same size),
replaced by rename with other content — over gRPC and shared memory: the daemon
stays up and keeps serving another model, never hands out a byte that does not
match its verified digest (clients check digests themselves: ``verify=True``),
reports the model with a precise reason (ListModels, per-model health, metrics),
and recovers on an explicit Reload or when the good file is renamed back into place.
A ``chmod`` does not take a model down; a rewrite that restores its mtime does.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from tests.reliability.files_support import (
    NOT_SERVING,
    SERVING,
    Served,
    assert_rank,
    fetch,
    flip_tail,
    health,
    metric,
    model_info,
    read_tensors,
    rename_into_place,
    serve_copy,
    wait_log,
    wait_state,
)
from tests.reliability.load_support import settle
from weightd.client import AdminClient, DataLossError
from weightd.server.checkpoint.description import Checkpoint, TensorInfo
from weightd.server.registry.filechange import (
    ChangeKind,
    inode_change,
    path_change,
    tensor_mismatch,
    version_difference,
)
from weightd.server.store.shards import FileIdentity

pytestmark = pytest.mark.e2e
TRANSPORTS = ("grpc", "shm")


@pytest.fixture
def served(transformers_models: dict[str, Path], tmp_path: Path):
    with serve_copy(tmp_path, transformers_models["llama"], transformers_models["qwen2"]) as s:
        # Every transport works before anything changes; rank 0's pack is built now,
        # rank 1's is not (a pack built after the damage is checked too).
        for transport in TRANSPORTS:
            assert_rank(fetch(s.target, "victim", 0, 2, transport), s.original, s.config, 2, 0)
        yield s
        _nothing_left_behind(s)


def _victim_descriptors(s: Served) -> list[str]:
    """What the daemon's open descriptors under the victim's directory point at."""
    fd_dir = Path(f"/proc/{s.daemon.process.pid}/fd")
    out = []
    for fd in fd_dir.iterdir():
        try:
            where = os.readlink(fd)
        except FileNotFoundError:
            continue  # closed while listing
        if where.startswith(f"{s.victim}/"):
            out.append(where)
    return out


def _nothing_left_behind(s: Served) -> None:
    """After every change and recovery: no lease, no stream, no stray descriptor.

    A replaced shard's old inode, the descriptors of a version verified aside and
    refused, of a version superseded by a reload: none may stay open. In ``stale`` the
    daemon holds the replaced inode on purpose; no test here ends in that state.
    """
    assert s.daemon.process.poll() is None, s.daemon.log()
    held = settle(s.daemon, lambda x: x.leases == 0 and x.fetch_streams == 0)
    assert held.leases == 0 and held.fetch_streams == 0, held.row()
    shards = sorted(str(p) for p in s.victim.glob("*.safetensors"))
    state = model_info(s.target, "victim").state
    assert state in ("ready", "broken"), state
    deadline = time.monotonic() + 10
    while True:  # a refused version's descriptors close when its verification ends
        open_now = sorted(_victim_descriptors(s))
        if open_now == shards or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    # One descriptor per shard, each the file now in the directory (none "(deleted)").
    assert open_now == shards, (state, open_now)


def _other_model_still_served(s: Served) -> None:
    assert s.daemon.process.poll() is None  # no SIGBUS, no crash
    other = read_tensors(s.other)
    for transport in TRANSPORTS:
        state = fetch(s.target, "other", 0, 1, transport)
        assert set(state) == set(other)
        assert all(state[n].equal(other[n]) for n in other)
    assert health(s.target, "other") == SERVING


def _refused(s: Served, shard: Path) -> None:
    """Every way of fetching the damaged model is DATA_LOSS naming the file."""
    for transport in TRANSPORTS:
        for rank in (0, 1):  # rank 0's pack was built before the damage, rank 1's not
            with pytest.raises(DataLossError) as err:
                fetch(s.target, "victim", rank, 2, transport)
            assert str(shard) in err.value.detail, (transport, rank, err.value.detail)


def _serves_verified_bytes(s: Served) -> None:
    for transport in TRANSPORTS:
        for rank in (0, 1):
            assert_rank(
                fetch(s.target, "victim", rank, 2, transport), s.original, s.config, 2, rank
            )
    assert health(s.target, "victim") == SERVING


def test_truncated_in_place_then_restored_by_an_atomic_replace(served: Served) -> None:
    s = served
    shard = s.shard(1)
    good = shard.read_bytes()
    os.truncate(shard, len(good) // 2)  # a file mapping would SIGBUS on the next touch

    info = wait_state(s, "victim", "broken", f"shard {shard} changed since it was verified")
    assert f"size changed from {len(good)} to {len(good) // 2} bytes" in info.reason
    assert not info.ready
    assert health(s.target, "victim") == NOT_SERVING
    _refused(s, shard)
    _other_model_still_served(s)
    url = s.metrics_url()
    assert metric(url, "weightd_model_state", model="victim", state="broken") == 1
    assert metric(url, "weightd_model_state", model="other", state="ready") == 1
    assert metric(url, "weightd_shard_changes_total", model="victim", change="content") == 1

    # A good-looking but different file renamed into place is verified, and refused.
    rename_into_place(shard, flip_tail(good))
    info = wait_state(s, "victim", "broken", "differs from the served version")
    assert f"shard {shard} was replaced on disk" in info.reason and "hashes to" in info.reason
    _refused(s, shard)

    # The verified content renamed back into place: re-verified, published, served.
    rename_into_place(shard, good)
    wait_state(s, "victim", "ready")
    _serves_verified_bytes(s)
    assert metric(url, "weightd_model_restores_total", model="victim", outcome="ok") == 1
    assert metric(url, "weightd_model_restores_total", model="victim", outcome="differs") == 1
    _other_model_still_served(s)


def test_overwritten_in_place_then_restored_by_an_admin_reload(served: Served) -> None:
    s = served
    shard = s.shard(0)
    good = shard.read_bytes()
    with open(shard, "r+b") as f:  # same inode, same size, other bytes
        f.seek(len(good) - 64)
        f.write(flip_tail(good)[-64:])
    assert shard.stat().st_size == len(good)

    info = wait_state(s, "victim", "broken", f"shard {shard} changed since it was verified")
    assert "modified in place" in info.reason
    assert health(s.target, "victim") == NOT_SERVING
    _refused(s, shard)
    _other_model_still_served(s)

    # Good again (written back in place): an explicit Reload verifies and publishes it.
    with open(shard, "r+b") as f:
        f.write(good)
    with AdminClient(s.admin_target, timeout=60) as admin:
        result = admin.reload("victim")
    assert result.num_tensors == len(s.original)
    assert model_info(s.target, "victim").state == "ready"
    _serves_verified_bytes(s)


def test_replaced_by_rename_serves_the_verified_version_until_reloaded(served: Served) -> None:
    s = served
    shard = s.shard(0)
    good = shard.read_bytes()
    rename_into_place(shard, flip_tail(good))

    # The daemon keeps its verified inode: what it serves is still the verified bytes,
    # and it says precisely that the directory no longer holds them.
    info = wait_state(s, "victim", "stale", "differs from the served version")
    assert f"shard {shard} was replaced on disk" in info.reason
    assert "the verified version is still served" in info.reason
    assert info.ready
    _serves_verified_bytes(s)
    _other_model_still_served(s)
    url = s.metrics_url()
    assert metric(url, "weightd_model_state", model="victim", state="stale") == 1
    assert metric(url, "weightd_model_state", model="victim", state="ready") == 0

    # The good file back in place: re-verified, and the condition clears.
    rename_into_place(shard, good)
    wait_state(s, "victim", "ready")
    _serves_verified_bytes(s)

    # An operator who wants the new content publishes it with Reload.
    rename_into_place(shard, flip_tail(good))
    wait_state(s, "victim", "stale")
    with AdminClient(s.admin_target, timeout=60) as admin:
        admin.reload("victim")
    assert model_info(s.target, "victim").state == "ready"
    now = read_tensors(s.victim)
    assert any(not now[n].equal(s.original[n]) for n in now)
    for transport in TRANSPORTS:
        assert_rank(fetch(s.target, "victim", 1, 2, transport), now, s.config, 2, 1)


def test_chmod_keeps_serving_but_a_rewrite_hiding_its_mtime_is_caught(served: Served) -> None:
    s = served
    shard = s.shard(0)
    os.chmod(shard, 0o600)  # ctime moves, nothing else
    wait_log(s, f"file_changed model=victim change=metadata outcome=re-verified shard={shard}")
    assert model_info(s.target, "victim").state == "ready"
    _serves_verified_bytes(s)

    # Rewritten in place with its mtime put back: only ctime shows it; the re-hash
    # catches it before anything is served from it.
    st = shard.stat()
    good = shard.read_bytes()
    s.daemon.process.send_signal(signal.SIGSTOP)  # so it cannot see the mtime move and back
    try:
        with open(shard, "r+b") as f:
            f.seek(len(good) - 64)
            f.write(flip_tail(good)[-64:])
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    finally:
        s.daemon.process.send_signal(signal.SIGCONT)
    assert shard.stat().st_mtime_ns == st.st_mtime_ns and shard.stat().st_size == st.st_size
    info = wait_state(s, "victim", "broken", f"shard {shard} no longer holds the verified bytes")
    assert "hashes to blake3:" in info.reason
    _refused(s, shard)
    _other_model_still_served(s)


# --- the rules, as a table (pure) ----------------------------------------------------------

_V = FileIdentity(dev=1, ino=10, size=100, mtime_ns=5, ctime_ns=7)


@pytest.mark.parametrize(
    ("held", "accepted", "kind", "words"),
    [
        (_V, 7, None, ""),
        (dataclasses.replace(_V, size=50), 7, ChangeKind.CONTENT, "size changed from 100 to 50"),
        (dataclasses.replace(_V, mtime_ns=6), 7, ChangeKind.CONTENT, "modified in place"),
        (dataclasses.replace(_V, mtime_ns=6, ctime_ns=9), 7, ChangeKind.CONTENT, "in place"),
        (dataclasses.replace(_V, ctime_ns=9), 7, ChangeKind.METADATA, "only its ctime"),
        (dataclasses.replace(_V, ctime_ns=9), 9, None, ""),  # re-hashed and accepted
    ],
)
def test_inode_change_table(
    held: FileIdentity, accepted: int, kind: ChangeKind | None, words: str
) -> None:
    got = inode_change("/m/a.safetensors", _V, held, accepted)
    assert (got.kind if got else None) is kind
    if got is not None:
        assert "/m/a.safetensors" in got.detail and words in got.detail


@pytest.mark.parametrize(
    ("at_path", "kind", "words"),
    [
        (_V, None, ""),
        (dataclasses.replace(_V, ctime_ns=99, size=1), None, ""),  # same inode: inode_change's
        (dataclasses.replace(_V, ino=11), ChangeKind.REPLACED, "inode 10 -> 11"),
        (dataclasses.replace(_V, dev=2), ChangeKind.REPLACED, "replaced on disk"),
        (None, ChangeKind.REMOVED, "removed from disk"),
    ],
)
def test_path_change_table(
    at_path: FileIdentity | None, kind: ChangeKind | None, words: str
) -> None:
    got = path_change("/m/a.safetensors", _V, at_path)
    assert (got.kind if got else None) is kind
    if got is not None:
        assert "/m/a.safetensors" in got.detail and words in got.detail


def _ckpt(tensors: dict[str, tuple[str, tuple[int, ...], str]], config: str = "{}") -> Checkpoint:
    infos = {
        n: TensorInfo(n, dtype, shape, shard, 0, 0) for n, (dtype, shape, shard) in tensors.items()
    }
    return Checkpoint(
        "m", "/m", {}, config, infos, tuple(sorted({t.shard for t in infos.values()}))
    )


def test_version_difference_compares_tensors_not_files() -> None:
    a = _ckpt({"w": ("F32", (2, 2), "a.safetensors"), "b": ("F32", (2,), "a.safetensors")})
    digests = {"w": "blake3:1", "b": "blake3:2"}
    # the same tensors saved into other shards: the same version
    moved = _ckpt({"w": ("F32", (2, 2), "x.safetensors"), "b": ("F32", (2,), "y.safetensors")})
    assert version_difference(a, digests, moved, digests) is None
    assert "hashes to blake3:9" in (
        version_difference(a, digests, a, {**digests, "w": "blake3:9"}) or ""
    )
    reshaped = _ckpt({"w": ("F32", (4,), "a.safetensors"), "b": ("F32", (2,), "a.safetensors")})
    assert "F32[4], served F32[2, 2]" in (version_difference(a, digests, reshaped, digests) or "")
    fewer = _ckpt({"w": ("F32", (2, 2), "a.safetensors")})
    assert "'b' is gone" in (version_difference(a, digests, fewer, {"w": "blake3:1"}) or "")
    assert "config.json" in (version_difference(a, digests, _ckpt({}, "{1}"), {}) or "")
    assert tensor_mismatch("/m/a", {"w": "blake3:1"}, digests) is None
    assert "'w' hashes to blake3:0" in (tensor_mismatch("/m/a", {"w": "blake3:0"}, digests) or "")


def test_store_serving_check_ignores_ctime_but_load_time_check_does_not(
    transformers_models: dict[str, Path], tmp_path: Path
) -> None:
    from weightd.server.base.errors import DataIntegrityError
    from weightd.server.checkpoint.scan import load_checkpoint

    model = tmp_path / "m"
    shutil.copytree(transformers_models["llama"], model)
    ckpt, store = load_checkpoint(str(model))
    try:
        shard = ckpt.shards[0]
        # Past the coarse clock tick the copy's ctime was taken in, so chmod moves it.
        ctime = (model / shard).stat().st_ctime_ns
        coarse = getattr(time, "CLOCK_REALTIME_COARSE", 5)  # 5 on Linux
        while time.clock_gettime_ns(coarse) <= ctime:
            time.sleep(0.001)
        os.chmod(model / shard, 0o600)
        store.check(shard)  # serving: metadata only, fine
        with pytest.raises(DataIntegrityError, match="ctime changed"):
            store.check_identical(shard)  # load: the hashed identity must be exact
    finally:
        store.close()
