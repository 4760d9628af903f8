"""One-pass hashing against hashlib/blake3 computed independently; the hash cache;
progress reporting."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
from pathlib import Path

import blake3
import pytest

from weightd.server.base.errors import DataIntegrityError
from weightd.server.store.shards import FileIdentity
from weightd.server.telemetry.progress import Reporter, render_bar
from weightd.server.trust.hashcache import CacheEntry, HashCache
from weightd.server.trust.hashing import Progress, ShardJob, TensorRange, hash_shard, hash_shards


def _file(tmp: Path, name: str, size: int) -> Path:
    path = tmp / name
    path.write_bytes(bytes((i * 31 + 7) % 256 for i in range(size)))
    return path


def _job(path: Path, ranges: list[tuple[int, int]], **kw: object) -> ShardJob:
    fd = os.open(path, os.O_RDONLY)
    tensors = tuple(TensorRange(f"t{i}", off, n) for i, (off, n) in enumerate(ranges))
    return ShardJob(path.name, str(path), fd, os.fstat(fd).st_size, tensors, **kw)  # type: ignore[arg-type]


RANGES = [(8, 0), (8, 100), (108, 1), (109, 0), (109, 5000), (5109, 3), (5112, 0)]


@pytest.mark.parametrize("block", [1, 7, 64, 4096, 1 << 20])
@pytest.mark.parametrize("depth", [1, 3])
def test_one_pass_matches_independent_digests(tmp_path: Path, block: int, depth: int) -> None:
    path = _file(tmp_path, "s", 5112)
    data = path.read_bytes()
    job = _job(path, RANGES, git_sha1=True)
    progress = Progress(len(data))
    try:
        got = hash_shard(job, progress, block_bytes=block, depth=depth)
    finally:
        os.close(job.fd)
    assert got.sha256 == hashlib.sha256(data).hexdigest()
    assert got.git_sha1 == hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    for t in job.tensors:
        want = blake3.blake3(data[t.offset : t.offset + t.nbytes]).hexdigest()
        assert got.tensors[t.name] == f"blake3:{want}", t
    assert progress.done == len(data)


def test_several_shards_in_parallel(tmp_path: Path) -> None:
    jobs = [_job(_file(tmp_path, f"s{i}", 1000 * (i + 1)), [(0, 1000 * (i + 1))]) for i in range(5)]
    try:
        got = hash_shards(jobs, threads=3, block_bytes=333)
    finally:
        for j in jobs:
            os.close(j.fd)
    assert list(got) == [j.name for j in jobs]
    for j in jobs:
        assert got[j.name].sha256 == hashlib.sha256(Path(j.path).read_bytes()).hexdigest()


def test_truncated_while_hashing_is_data_loss(tmp_path: Path) -> None:
    path = _file(tmp_path, "s", 10_000)
    job = _job(path, [(0, 10_000)])
    os.truncate(path, 5000)
    try:
        with pytest.raises(DataIntegrityError, match="short read"):
            hash_shard(job, block_bytes=1024)
    finally:
        os.close(job.fd)


def test_the_check_after_the_pass_runs(tmp_path: Path) -> None:
    path = _file(tmp_path, "s", 100)
    fd = os.open(path, os.O_RDONLY)

    def changed() -> None:
        raise DataIntegrityError("changed while hashing")

    job = ShardJob("s", str(path), fd, 100, (TensorRange("t", 0, 100),), check=changed)
    try:
        with pytest.raises(DataIntegrityError, match="changed while hashing"):
            hash_shard(job)
    finally:
        os.close(fd)


# --- the cache ----------------------------------------------------------------------------


def _entry(path: Path) -> tuple[CacheEntry, FileIdentity, tuple[TensorRange, ...]]:
    job = _job(path, [(0, 40), (40, 60)])
    try:
        digests = hash_shard(job)
    finally:
        os.close(job.fd)
    identity = FileIdentity.of(os.stat(path))
    return CacheEntry(str(path), identity, job.tensors, digests), identity, job.tensors


def test_cache_round_trip_and_key(tmp_path: Path) -> None:
    path = _file(tmp_path, "s", 100)
    entry, identity, ranges = _entry(path)
    cache = HashCache(str(tmp_path / "cache"), str(tmp_path))
    assert cache.lookup("s", str(path), identity, ranges) is None
    cache.update({"s": entry})
    assert oct(os.stat(tmp_path / "cache").st_mode & 0o777) == "0o700"
    fresh = HashCache(str(tmp_path / "cache"), str(tmp_path))
    assert fresh.lookup("s", str(path), identity, ranges) == entry.digests
    # any part of the key differing: a miss
    for field in ("dev", "ino", "size", "mtime_ns", "ctime_ns"):
        other = dataclasses.replace(identity, **{field: getattr(identity, field) + 1})
        assert fresh.lookup("s", str(path), other, ranges) is None, field
    assert fresh.lookup("s", str(tmp_path / "elsewhere"), identity, ranges) is None
    assert fresh.lookup("s", str(path), identity, ranges[:1]) is None
    shifted = (ranges[0], TensorRange(ranges[1].name, 41, 59))
    assert fresh.lookup("s", str(path), identity, shifted) is None
    assert fresh.lookup("s", str(path), identity, ranges, git_sha1=True) is None  # not cached


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{not json",
        b"[]",
        b'{"version": 99}',
        b"\xff\xfe",
        json.dumps({"version": 1}).encode(),
    ],
)
def test_corrupt_cache_is_ignored(
    tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    path = _file(tmp_path, "s", 100)
    entry, identity, ranges = _entry(path)
    cache = HashCache(str(tmp_path / "cache"), str(tmp_path))
    cache.update({"s": entry})
    Path(cache.path).write_bytes(content)
    with caplog.at_level(logging.WARNING):
        again = HashCache(str(tmp_path / "cache"), str(tmp_path))
        assert again.lookup("s", str(path), identity, ranges) is None
    again.update({"s": entry})  # and it is rewritten whole
    assert HashCache(str(tmp_path / "cache"), str(tmp_path)).lookup(
        "s", str(path), identity, ranges
    )


@pytest.mark.parametrize("planted", ["other-owner", "group-writable", "symlink", "open-dir"])
def test_a_cache_another_user_could_have_written_is_not_trusted(
    tmp_path: Path, planted: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Whoever can write the cache can make the daemon skip hashing: a well-formed cache
    that is not the daemon's user's own is ignored (the shards are hashed)."""
    path = _file(tmp_path, "s", 100)
    entry, identity, ranges = _entry(path)
    cache = HashCache(str(tmp_path / "cache"), str(tmp_path))
    cache.update({"s": entry})
    good = Path(cache.path)
    if planted == "other-owner":
        if os.geteuid() != 0:
            pytest.skip("needs root to give the file to another user")
        os.chown(good, 65534, 65534)
    elif planted == "group-writable":
        good.chmod(0o664)
    elif planted == "symlink":
        real = tmp_path / "elsewhere.json"
        good.rename(real)
        good.symlink_to(real)
    else:
        (tmp_path / "cache").chmod(0o777)
    with caplog.at_level(logging.WARNING):
        again = HashCache(str(tmp_path / "cache"), str(tmp_path))
        assert again.lookup("s", str(path), identity, ranges) is None
    assert "is not trusted" in caplog.text or "cannot read" in caplog.text


def test_cache_entry_with_wrong_types_is_a_miss(tmp_path: Path) -> None:
    path = _file(tmp_path, "s", 100)
    entry, identity, ranges = _entry(path)
    cache = HashCache(str(tmp_path / "cache"), str(tmp_path))
    cache.update({"s": entry})
    doc = json.loads(Path(cache.path).read_text())
    doc["shards"]["s"]["tensors"][0][3] = 12
    Path(cache.path).write_text(json.dumps(doc))
    assert (
        HashCache(str(tmp_path / "cache"), str(tmp_path)).lookup("s", str(path), identity, ranges)
        is None
    )


def test_load_model_uses_the_cache_and_reverify_forces_hashing(tmp_path: Path) -> None:
    from tests.trust import craft
    from weightd.server.trust.verify import VerifyOptions, verify_checkpoint

    d = craft.write_checkpoint(tmp_path / "m")
    options = VerifyOptions(hash_cache_dir=str(tmp_path / "cache"), progress=False)
    first = verify_checkpoint(str(d), None, options)
    first.store.close()
    assert first.ok and first.cached_shards == [] and first.hashed_bytes > 0
    second = verify_checkpoint(str(d), None, options)
    second.store.close()
    assert second.ok and sorted(second.cached_shards) == [craft.SHARD1, craft.SHARD2]
    assert second.hashed_bytes == 0 and second.tensor_digests == first.tensor_digests
    forced = verify_checkpoint(
        str(d), None, VerifyOptions(**{**options.__dict__, "reverify": True})
    )
    forced.store.close()
    assert forced.cached_shards == [] and forced.tensor_digests == first.tensor_digests
    # touching one shard (same bytes, new mtime/ctime) rehashes that shard only
    os.utime(d / craft.SHARD2, ns=(1, 1))
    third = verify_checkpoint(str(d), None, options)
    third.store.close()
    assert third.cached_shards == [craft.SHARD1]


# --- progress -----------------------------------------------------------------------------


def test_render_bar() -> None:
    line = render_bar("hashing m", 1 << 30, 4 << 30, 1.0)
    assert (
        line.startswith("hashing m [#######-") and "25.0%" in line and "1.00 GiB/4.00 GiB" in line
    )


def test_reporter_tty_draws_and_ends_the_line() -> None:
    out = io.StringIO()
    r = Reporter("hashing m", stream=out, tty=True)
    r.advance(100, 100)
    r.close()
    assert out.getvalue().startswith("\rhashing m [") and out.getvalue().endswith("\n")


def test_reporter_without_tty_logs(caplog: pytest.LogCaptureFixture) -> None:
    out = io.StringIO()
    r = Reporter("hashing m", stream=out, tty=False, log_interval_s=0.0)
    with caplog.at_level(logging.INFO, logger="weightd.hashing"):
        r.advance(10, 100)
        r.advance(100, 100)
        r.close()
    assert out.getvalue() == ""
    assert any("hashing m: " in m and "(10%)" in m for m in caplog.messages)


def test_file_sha256_only_when_something_compares_it(tmp_path: Path) -> None:
    from tests.trust import craft
    from tests.trust.corpus import manifest_of
    from weightd.server.trust.verify import VerifyOptions, verify_checkpoint

    d = craft.write_checkpoint(tmp_path / "m")
    cache = str(tmp_path / "cache")
    plain = verify_checkpoint(str(d), None, VerifyOptions(progress=False, hash_cache_dir=cache))
    plain.store.close()
    assert plain.ok and set(plain.files) == {"config.json", craft.INDEX}  # no shard SHA-256
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps(manifest_of(d)))
    options = VerifyOptions(progress=False, hash_cache_dir=cache, manifests={"": str(manifest)})
    checked = verify_checkpoint(str(d), None, options)
    checked.store.close()
    # the cache entries lacked the file digest the manifest needs: hashed again
    assert checked.ok and checked.cached_shards == [] and craft.SHARD1 in checked.files
    again = verify_checkpoint(str(d), None, options)
    again.store.close()
    assert again.ok and sorted(again.cached_shards) == [craft.SHARD1, craft.SHARD2]


class _Stop(BaseException):
    """What a signal handler raises in the main thread to stop start-up."""


def test_a_signal_during_hashing_stops_every_shard_at_once(tmp_path: Path) -> None:
    """Ctrl-C while start-up hashes: the pass ends within a block, shards not started are
    dropped, and progress never reaches 100 % (it used to hash everything first)."""
    import signal
    import threading
    import time

    jobs = []
    for i in range(4):
        path = tmp_path / f"s{i}"
        with open(path, "wb") as f:
            f.truncate(8 << 20)  # sparse: no disk, eight 1 MiB blocks each
        jobs.append(_job(path, [(0, 8 << 20)]))
    seen: list[int] = []
    progress = Progress(32 << 20, lambda done, total: (seen.append(done), time.sleep(0.05)))

    def on_alarm(signum: int, frame: object) -> None:
        raise _Stop

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    started = time.monotonic()
    try:
        with pytest.raises(_Stop):
            hash_shards(jobs, threads=2, progress=progress, block_bytes=1 << 20)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        for job in jobs:
            os.close(job.fd)
    assert time.monotonic() - started < 1.5  # all of it would take 32 x 0.05 / 2 = 0.8 s more
    assert max(seen) < 32 << 20
    assert not [t for t in threading.enumerate() if t.name.startswith("weightd-hash")]
