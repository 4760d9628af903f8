"""weightd against a hostile S3-compatible store (:mod:`tests.s3.hostile_store`, out of
process): every read bounded in bytes and time, every failure one precise line, nothing
unverified served or cached, the other models serving throughout, and a restart on a
well-behaved store serving the right bytes.

Bounds are asserted with the daemon's own evidence: its peak RSS (``VmHWM`` in
``/proc``), the requests and bytes the store saw, the daemon's log timestamps; never
with a test's wall clock.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import weightd_command
from tests.health import wait_serving
from tests.s3.conftest import (
    HostileStore,
    make_key,
    make_manifest,
    metric,
    scrape,
    write_blob_model,
)
from weightd.client import WeightClient
from weightd.client.api.admin import AdminClient

pytestmark = pytest.mark.e2e

#: Tight bounds, so that each scenario ends within seconds (the defaults: 30 s grace).
FAST = [
    "--s3-rate-grace-seconds",
    "2",
    "--s3-min-bytes-per-second",
    str(256 << 10),
    "--s3-request-seconds",
    "5",
    "--s3-list-seconds",
    "10",
    "--s3-max-attempts",
    "2",
    "--s3-part-bytes",
    str(256 << 10),
    "--metrics-listen",
    "127.0.0.1:0",
    "--watch-interval",
    "0",
]
#: Peak resident memory a daemon serving these 1-2 MiB models may reach, whatever the
#: store does (it idles at ~150-250 MiB here: Python, torch, gRPC).
MAX_RSS_BYTES = 600 << 20
_TS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


@dataclass
class Daemon:
    process: subprocess.Popen[str]
    tmp: Path
    log_path: Path

    @property
    def target(self) -> str:
        return f"unix://{self.tmp / 'run' / 'weightd.sock'}"

    def admin(self, timeout: float = 60) -> AdminClient:
        return AdminClient(f"unix://{self.tmp / 'run' / 'admin.sock'}", timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text()

    def peak_rss(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM")

    def states(self) -> dict[str, tuple[str, str]]:
        with WeightClient(self.target, timeout=30) as c:
            return {m.name: (m.state, m.reason) for m in c.list_models()}

    def wait_state(self, model: str, states: Sequence[str], timeout: float = 90) -> str:
        """Wait for ``model`` to reach one of ``states``; its reason then."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log()
            with contextlib.suppress(Exception):
                state, reason = self.states()[model]
                if state in states:
                    return reason
            time.sleep(0.1)
        raise AssertionError(f"{model} never reached {states}:\n{self.log()}")

    def seconds_between(self, first: str, then: str) -> float:
        """Seconds between the first log lines holding ``first`` and ``then`` (the
        daemon's own clock)."""

        def when(text: str) -> datetime.datetime:
            for line in self.log().splitlines():
                m = _TS.match(line)
                if m and text in line:
                    return datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
            raise AssertionError(f"no log line with {text!r}:\n{self.log()}")

        return (when(then) - when(first)).total_seconds()


@contextlib.contextmanager
def serve(
    tmp: Path,
    hostile: HostileStore,
    models: Sequence[tuple[str, str]],
    extra: Sequence[str] = (),
    *,
    ready: str,
) -> Iterator[Daemon]:
    """``weightd serve`` out of process against the hostile store, until the block ends;
    yields once model ``ready`` serves (the others may still load, or have failed)."""
    log_path = tmp / f"daemon-{time.monotonic_ns()}.log"
    args = ["serve", "--listen", f"unix://{tmp / 'run' / 'weightd.sock'}"]
    for name, source in models:
        args += ["--model", f"{name}={source}"]
    args += ["--s3-endpoint", hostile.endpoint, *FAST, *extra]
    env = dict(os.environ, WEIGHTD_CACHE_DIR=str(tmp / "cache"), **hostile.env())
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            weightd_command(*args), stdout=log, stderr=subprocess.STDOUT, text=True, env=env
        )
    d = Daemon(process, tmp, log_path)
    try:
        wait_serving(d.target, process, log_path, service=f"weightd.v1.Weights/{ready}")
        yield d
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name


def cached_versions(tmp: Path) -> list[Path]:
    """Complete version directories in the daemon's source cache."""
    return sorted(
        p for p in (tmp / "cache").glob("sources/*/v-*") if not p.name.endswith(".partial")
    )


@pytest.fixture(scope="module")
def blob(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_blob_model(tmp_path_factory.mktemp("blob") / "m", 1, seed=3)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_key(tmp_path_factory.mktemp("keys"))


# --- cases 1, 2, 3, 7, 8: one daemon, one hostile bucket per model -------------------


def test_each_hostile_bucket_fails_alone_bounded_and_a_restart_serves_the_right_bytes(
    hostile: HostileStore,
    blob: Path,
    keys: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    """Ten models, each from a bucket that misbehaves its own way, beside a local one:
    all load at once; each hostile one fails with its own precise line within its bound,
    while the local model serves from the start; the daemon's memory stays bounded;
    nothing is cached; restarted on a well-behaved store, every model serves its bytes."""
    private, public = keys
    manifest = make_manifest(blob, tmp_path / "manifest.json", private)
    local = write_blob_model(tmp_path / "local", 1, seed=4)
    forged = "Evil\n2026-12-07 05:00:00,000 INFO weightd: serving models=forged"
    scenarios: dict[str, dict[str, dict[str, object]]] = {
        # 1: a manifest (and a shard) whose GET never ends
        "endless": {"endless_body": {"keys_ending": ["manifest.json"]}},
        "endless-shard": {"endless_body": {"keys_ending": [".safetensors"]}},
        # 2: listings that never end, or one page of 400k keys
        "empty-pages": {"empty_pages": {}},
        "same-token": {"same_token": {}},
        "huge-page": {"huge_page": {"keys": 400_000}},
        "slow-list": {"slow_list": {"every": 0.5}},
        # 3: a shard dripped one byte every half second; headers dripped
        "drip": {"drip": {"every": 0.5, "keys_ending": [".safetensors"]}},
        "drip-headers": {"drip_headers": {"every": 0.5, "keys_ending": [".safetensors"]}},
        # 7: a forged error code with a newline and a 4 MiB message
        "forged": {"error": {"status": 400, "code": forged, "message_bytes": 4 << 20}},
        # 8: malformed answers
        "missing-key": {"missing_key": {}},
        "duplicate-key": {"duplicate_key": {}},
        "bad-size": {"bad_size": {"value": "12x", "keys_ending": [".safetensors"]}},
        "negative-size": {"bad_size": {"value": "-5", "keys_ending": [".safetensors"]}},
        "bad-range": {"bad_range": {"value": "bytes 0-9/abc"}},
    }
    expected = {
        "endless": r"manifest\.json: range \[0, \d+\) sent more than the \d+ bytes asked for",
        "endless-shard": r"model\.safetensors: range \[\d+, \d+\) sent more than the \d+ bytes",
        "empty-pages": r"3 truncated listing pages in a row hold no entry",
        "same-token": r"listing page 2 repeats an earlier continuation token",
        "huge-page": r"listing page 1: an answer over the 4194304-byte bound",
        "slow-list": r"listing page 1: no complete answer within 5 s",
        "drip": r"model\.safetensors: range \[\d+, \d+\): \d+ bytes in [\d.]+ s, below the "
        r"minimum of 262144 bytes/s after a 2 s grace",
        "drip-headers": r"model\.safetensors: range \[\d+, \d+\): 0 bytes in [\d.]+ s, below",
        "forged": r"the store answered 400",
        "missing-key": r"listing entry 1 has no Key",
        "duplicate-key": r"model\.safetensors: listed twice",
        "bad-size": r"could not be read|the store gave Size '12x': not a size",
        "negative-size": r"the store gave Size '-5': not a size",
        "bad-range": r"Content-Range 'bytes 0-9/abc' is not 'bytes FIRST-LAST/SIZE'",
    }
    models = [("local", str(local))]
    extra = [
        "--trust-key",
        str(public),
        "--manifest",
        f"local={make_manifest(local, tmp_path / 'l.json', private)}",
    ]
    buckets = {}
    for name, scenario in scenarios.items():
        bucket = hostile.bucket()
        buckets[name] = bucket
        hostile.upload_dir(blob, bucket, "m/")
        hostile.put(bucket, "manifest.json", manifest.read_bytes())
        hostile.scenario(bucket, **scenario)
        models.append((name, f"s3://{bucket}/m/"))
        extra += ["--manifest", f"{name}=s3://{bucket}/manifest.json"]
    with serve(tmp_path, hostile, models, extra, ready="local") as d:
        with WeightClient(d.target, timeout=60) as client:
            same(client.fetch(0, 1, model="local"), load_file(str(local / "model.safetensors")))
            reasons = {name: d.wait_state(name, ["failed"], timeout=120) for name in scenarios}
            # The local model served throughout, and still does.
            same(client.fetch(0, 1, model="local"), load_file(str(local / "model.safetensors")))
        for name, pattern in expected.items():
            assert re.search(pattern, reasons[name]), (name, reasons[name])
            assert f"s3://{buckets[name]}/" in reasons[name], (name, reasons[name])
        log = d.log()
        # 7: the store's words never forge a line nor write a long one.
        assert "Evil" not in log or "'Evil\\n" in log
        assert not any(line.startswith("2026-12-07 05:00:00,000") for line in log.splitlines())
        assert max(len(line) for line in log.splitlines()) < 16 << 10
        assert "Traceback" not in log
        # Bounded: memory, requests, bytes, time (the daemon's own clock).
        assert d.peak_rss() < MAX_RSS_BYTES, d.peak_rss()
        assert hostile.stats(buckets["empty-pages"])["list"] == 3
        assert hostile.stats(buckets["same-token"])["list"] == 2
        assert hostile.stats(buckets["huge-page"]).get("bytes", 0) < 64 << 20
        assert hostile.stats(buckets["endless"]).get("bytes", 0) < 64 << 20
        # The local model served before the dripping ones had even failed (they need
        # their 2 s grace at least): loads are independent.
        assert d.seconds_between("verified model=local", "model drip failed to load") > 0
        assert d.seconds_between("verified model=local", "model slow-list failed") > 0
        # Each hostile model ended within its bound: grace 2 s + one range at the minimum
        # rate (1 s), the listing's 10 s; all of them loaded at once.
        assert d.seconds_between("start pid=", "serving models=local") < 30
        text = scrape(_metrics_url(d.log()))
        assert metric(text, "weightd_model_state", {"model": "drip", "state": "failed"}) == 1
        assert metric(text, "weightd_model_state", {"model": "local", "state": "ready"}) == 1
        failures = "weightd_source_failures_total"
        assert metric(text, failures, {"reason": "too_slow"}) == 3  # drips, slow listing
        assert metric(text, failures, {"reason": "short_object"}) == 2  # endless bodies
        assert metric(text, failures, {"reason": "protocol"}) == 8  # malformed, unbounded
        assert metric(text, failures, {"reason": "store_error"}) == 1  # the forged code
        # Nothing the hostile buckets sent is cached as a version.
        assert not cached_versions(tmp_path)
    # A restart on the store behaving again serves every model, bit for bit.
    for bucket in buckets.values():
        hostile.scenario(bucket)
    with (
        serve(tmp_path, hostile, models, extra, ready="drip") as d,
        WeightClient(d.target, timeout=60) as client,
    ):
        want = load_file(str(blob / "model.safetensors"))
        for name in scenarios:
            d.wait_state(name, ["ready"])
            same(client.fetch(0, 1, model=name), want)


def _metrics_url(log: str) -> str:
    from tests.health import listening_address

    url = listening_address(log, "metrics")
    assert url is not None
    return url


# --- cases 2 and 3 on reload: the caller's deadline holds, the lock is never held -----


def test_a_reload_honours_its_deadline_and_never_blocks_the_next(
    hostile: HostileStore, blob: Path, tmp_path: Path
) -> None:
    """A reload whose listing drips, then one whose new shard drips: each answers
    DEADLINE_EXCEEDED by its deadline, publishes nothing (the verified version serves),
    and the next reload is not blocked; once the store behaves, a reload publishes."""
    from weightd.client.base.errors import DeadlineExceededError

    local = write_blob_model(tmp_path / "local", 1, seed=5)
    v2 = write_blob_model(tmp_path / "v2", 1, seed=6)
    bucket = hostile.bucket()
    hostile.upload_dir(blob, bucket, "m/")
    models = [("local", str(local)), ("remote", f"s3://{bucket}/m/")]
    want_v1 = load_file(str(blob / "model.safetensors"))
    with (
        serve(tmp_path, hostile, models, ["--trust-object-store"], ready="remote") as d,
        WeightClient(d.target, timeout=60) as client,
    ):
        same(client.fetch(0, 1, model="remote"), want_v1)
        hostile.scenario(bucket, slow_list={"every": 0.5})
        for _ in range(2):  # the second is not blocked by the first
            with d.admin(timeout=3) as admin, pytest.raises(DeadlineExceededError) as caught:
                admin.reload("remote")
            assert "remote" in str(caught.value), caught.value
        hostile.upload_dir(v2, bucket, "m/")
        hostile.scenario(bucket, drip={"every": 0.5, "keys_ending": [".safetensors"]})
        # (1.5 s: before the minimum rate, after its 2 s grace, would end it anyway)
        with d.admin(timeout=1.5) as admin, pytest.raises(DeadlineExceededError) as caught:
            admin.reload("remote")
        assert "did not finish within" in str(caught.value), caught.value
        same(client.fetch(0, 1, model="remote"), want_v1)  # nothing was published
        same(client.fetch(0, 1, model="local"), load_file(str(local / "model.safetensors")))
        assert "outcome=timed_out" in d.log()
        hostile.scenario(bucket)
        with d.admin(timeout=60) as admin:
            deadline = time.monotonic() + 30
            while True:  # the cancelled load lets go of the lock within moments
                try:
                    admin.reload("remote")
                    break
                except DeadlineExceededError:
                    assert time.monotonic() < deadline
        same(client.fetch(0, 1, model="remote"), load_file(str(v2 / "model.safetensors")))
        assert d.peak_rss() < MAX_RSS_BYTES


# --- case 5: failed reloads never touch the serving version ---------------------------


def test_failed_reloads_never_prune_the_serving_version_and_a_restart_is_warm(
    hostile: HostileStore, blob: Path, tmp_path: Path
) -> None:
    """Five reloads that download a version failing verification: each is refused and
    its download removed, the serving version's directory stays, the cache never holds
    more than two versions; a restart finds the serving version warm."""
    from weightd.client.base.errors import FailedPreconditionError

    local = write_blob_model(tmp_path / "local", 1, seed=7)
    bucket = hostile.bucket()
    hostile.upload_dir(blob, bucket, "m/")
    models = [("local", str(local)), ("remote", f"s3://{bucket}/m/")]
    want = load_file(str(blob / "model.safetensors"))
    with (
        serve(tmp_path, hostile, models, ["--trust-object-store"], ready="remote") as d,
        WeightClient(d.target, timeout=60) as client,
        d.admin() as admin,
    ):
        (serving,) = cached_versions(tmp_path)
        for i in range(5):
            bad = write_blob_model(tmp_path / f"bad{i}", 1, seed=10 + i)
            hostile.upload_dir(bad, bucket, "m/")
            hostile.put(bucket, "m/config.json", b'{"architectures": [' + bytes([48 + i]))
            with pytest.raises(FailedPreconditionError, match=r"config\.json"):
                admin.reload("remote")
            assert cached_versions(tmp_path) == [serving]
            same(client.fetch(0, 1, model="remote"), want)
            same(client.fetch(0, 1, model="local"), load_file(str(local / "model.safetensors")))
        assert (
            metric(
                scrape(_metrics_url(d.log())),
                "weightd_model_state",
                {"model": "remote", "state": "ready"},
            )
            == 1
        )
    hostile.upload_dir(blob, bucket, "m/")  # the served version is back in the store
    with (
        serve(tmp_path, hostile, models, ["--trust-object-store"], ready="remote") as d,
        WeightClient(d.target, timeout=60) as client,
    ):
        same(client.fetch(0, 1, model="remote"), want)
        text = scrape(_metrics_url(d.log()))
        assert metric(text, "weightd_source_downloaded_bytes_total", {"kind": "model"}) == 0
        assert metric(text, "weightd_source_downloads_total", {"outcome": "warm"}) == 1


# --- case 6: an unsigned manifest in the bucket is no trust root ---------------------


def test_an_unsigned_manifest_in_the_bucket_is_not_a_trust_root(
    hostile: HostileStore, blob: Path, keys: tuple[Path, Path], tmp_path: Path
) -> None:
    """A rewritten shard with a matching rewritten unsigned ``s3://`` manifest is
    refused (nothing of the shard downloaded); signed by a --trust-key it is served."""
    private, public = keys
    local = write_blob_model(tmp_path / "local", 1, seed=8)
    evil = write_blob_model(tmp_path / "evil", 1, seed=9)
    bucket = hostile.bucket()
    hostile.upload_dir(evil, bucket, "m/")
    hostile.put(bucket, "manifest.json", make_manifest(evil, tmp_path / "evil.json").read_bytes())
    models = [("local", str(local)), ("remote", f"s3://{bucket}/m/")]
    extra = ["--manifest", f"remote=s3://{bucket}/manifest.json"]
    with serve(tmp_path, hostile, models, extra, ready="local") as d:
        reason = d.wait_state("remote", ["failed"])
        assert (
            f"manifest s3://{bucket}/manifest.json comes from the object store and is not "
            "signed by a --trust-key" in reason
        ), reason
        with WeightClient(d.target, timeout=60) as client:
            same(client.fetch(0, 1, model="local"), load_file(str(local / "model.safetensors")))
        assert hostile.stats(bucket).get("get", 0) == 1  # the manifest; no shard byte
        assert not cached_versions(tmp_path)
    # Signed by the operator's key: the origin is proven, the bytes are served.
    hostile.upload_dir(blob, bucket, "m/")
    signed = make_manifest(blob, tmp_path / "signed.json", private)
    hostile.put(bucket, "manifest.json", signed.read_bytes())
    extra += [
        "--trust-key",
        str(public),
        "--manifest",
        f"local={make_manifest(local, tmp_path / 'l.json', private)}",
    ]
    with (
        serve(tmp_path, hostile, models, extra, ready="remote") as d,
        WeightClient(d.target, timeout=60) as client,
    ):
        same(client.fetch(0, 1, model="remote"), load_file(str(blob / "model.safetensors")))


# --- case 9: an answer that cannot prove its version ---------------------------------


def test_answers_that_cannot_prove_their_version_are_refused(
    hostile: HostileStore, blob: Path, tmp_path: Path
) -> None:
    """--trust-object-store, multipart ETags (no MD5 to check), a store that ignores
    If-Match, drops ETag and Content-Range and answers later ranges from another object:
    refused, nothing cached; the store fixed, a restart serves the right bytes."""
    other = write_blob_model(tmp_path / "other", 1, seed=11)
    local = write_blob_model(tmp_path / "local", 1, seed=12)
    bucket = hostile.bucket()
    hostile.upload_dir(blob, bucket, "m/")
    hostile.put(bucket, "other/model.safetensors", (other / "model.safetensors").read_bytes())
    hostile.scenario(
        bucket,
        multipart_etag={},
        ignore_if_match={},
        drop_headers={},
        mix={"other": "other/model.safetensors", "keys_ending": [".safetensors"]},
    )
    models = [("local", str(local)), ("remote", f"s3://{bucket}/m/")]
    with serve(tmp_path, hostile, models, ["--trust-object-store"], ready="local") as d:
        reason = d.wait_state("remote", ["failed"])
        assert "carries no ETag: it cannot prove which version of the object it came from" in reason
        assert f"s3://{bucket}/m/" in reason
        assert not cached_versions(tmp_path)
        # A failed model comes back with a reload once its store behaves.
        hostile.scenario(bucket, multipart_etag={})
        with d.admin() as admin:
            admin.reload("remote")
        with WeightClient(d.target, timeout=60) as client:
            same(client.fetch(0, 1, model="remote"), load_file(str(blob / "model.safetensors")))
        assert d.states()["remote"][0] == "ready"
    shutil.rmtree(tmp_path / "cache")  # the restart downloads again
    with (
        serve(tmp_path, hostile, models, ["--trust-object-store"], ready="remote") as d,
        WeightClient(d.target, timeout=60) as client,
    ):
        same(client.fetch(0, 1, model="remote"), load_file(str(blob / "model.safetensors")))


# --- case 10: names the cache must hold ----------------------------------------------


def test_long_names_and_an_object_named_like_the_journal_are_cached_and_kept(
    hostile: HostileStore, blob: Path, tmp_path: Path
) -> None:
    """A 255-byte object name and an object called ``journal.json`` are downloaded and
    kept: a restart downloads nothing."""
    bucket = hostile.bucket()
    hostile.upload_dir(blob, bucket, "m/")
    long_name = "a" * 250 + ".json"
    hostile.put(bucket, f"m/{long_name}", b"{}")
    hostile.put(bucket, "m/journal.json", b'{"mine": true}')
    models = [("remote", f"s3://{bucket}/m/")]
    for outcome in ("downloaded", "warm"):
        with serve(tmp_path, hostile, models, ["--trust-object-store"], ready="remote") as d:
            with WeightClient(d.target, timeout=60) as client:
                same(client.fetch(0, 1), load_file(str(blob / "model.safetensors")))
            text = scrape(_metrics_url(d.log()))
            assert metric(text, "weightd_source_downloads_total", {"outcome": outcome}) == 1
            (version,) = cached_versions(tmp_path)
            assert (version / long_name).read_bytes() == b"{}"
            assert (version / "journal.json").read_bytes() == b'{"mine": true}'


# --- cases 4 and 10: adapters judged before they are pulled ---------------------------


def test_adapters_are_judged_by_their_listed_sizes_before_any_get(
    hostile: HostileStore, tmp_path: Path
) -> None:
    """Over the budget, or a config over its limit: refused before the first GET, nothing
    cached. A digest mismatch names the s3:// object, and its download is removed; the
    right digest loads the same adapter."""
    from tests.adapters.conftest import BASE_CONFIG, make_adapter
    from tests.models import build_model
    from tests.s3.test_s3_adapters import _digest
    from weightd.client.base.errors import (
        DataLossError,
        FailedPreconditionError,
        ResourceExhaustedError,
    )

    base = tmp_path / "tiny-llama"
    build_model("llama", BASE_CONFIG).save_pretrained(str(base))
    make_adapter(base, tmp_path / "good", 1, 4)
    size = sum(
        (tmp_path / "good" / f).stat().st_size
        for f in ("adapter_config.json", "adapter_model.safetensors")
    )
    bucket = hostile.bucket()
    hostile.upload_dir(tmp_path / "good", bucket, "adapters/good/")
    hostile.upload_dir(tmp_path / "good", bucket, "adapters/big-config/")
    config = (tmp_path / "good" / "adapter_config.json").read_bytes()
    hostile.put(bucket, "adapters/big-config/adapter_config.json", config + b" " * (5 << 20))
    hostile.upload_dir(tmp_path / "good", bucket, "adapters/big/")
    root = f"s3://{bucket}/adapters/"
    extra = ["--adapter-root", root, "--adapter-budget-bytes", str(size - 1)]
    with serve(tmp_path, hostile, [("tiny-llama", str(base))], extra, ready="tiny-llama") as d:
        digest = _digest(tmp_path / "good")
        with d.admin() as admin:
            with pytest.raises(ResourceExhaustedError):
                admin.load_adapter("a", root + "big/", expected_digest=digest)
            with pytest.raises(FailedPreconditionError, match=r"over the 4194304-byte limit"):
                admin.load_adapter("b", root + "big-config/", expected_digest=digest)
            assert hostile.stats(bucket).get("get", 0) == 0  # nothing was pulled
            assert not cached_versions(tmp_path)
        with WeightClient(d.target, timeout=60) as client:  # the model serves throughout
            assert client.fetch(0, 2, model="tiny-llama")
    extra[-1] = str(size * 2)
    with (
        serve(tmp_path, hostile, [("tiny-llama", str(base))], extra, ready="tiny-llama") as d,
        d.admin() as admin,
    ):
        if True:
            wrong = "sha256:" + "0" * 64
            with pytest.raises(DataLossError) as caught:
                admin.load_adapter("c", root + "good/", expected_digest=wrong)
            assert str(caught.value).startswith(f"DATA_LOSS: {root}good/: adapter digest")
            assert str(tmp_path / "cache") not in str(caught.value)
            assert not cached_versions(tmp_path)
            assert admin.load_adapter("c", root + "good/", expected_digest=digest).digest == digest


def test_sigterm_while_a_store_drips_stops_at_once(
    hostile: HostileStore, blob: Path, tmp_path: Path
) -> None:
    """A store dripping under the default 30 s grace (so the rate has not ended it yet):
    SIGTERM during start-up closes its connections and the daemon exits 0 at once."""
    local = write_blob_model(tmp_path / "local", 1, seed=13)
    bucket = hostile.bucket()
    hostile.upload_dir(blob, bucket, "m/")
    hostile.scenario(bucket, drip={"every": 0.5, "keys_ending": [".safetensors"]})
    models = [("local", str(local)), ("remote", f"s3://{bucket}/m/")]
    extra = ["--trust-object-store", "--s3-rate-grace-seconds", "30"]
    with serve(tmp_path, hostile, models, extra, ready="local") as d:
        assert d.states()["remote"][0] == "loading"
        d.process.send_signal(signal.SIGTERM)
        assert d.process.wait(30) == 0, d.log()
        log = d.log()
        assert "exit status=0" in log and "Traceback" not in log
        assert d.seconds_between("start pid=", "exit status=0") < 20
        assert not cached_versions(tmp_path)


def test_the_daemons_own_throttle_is_not_taken_for_a_slow_store(
    hostile: HostileStore, blob: Path, tmp_path: Path
) -> None:
    """--s3-max-bytes-per-second far below --s3-min-bytes-per-second across concurrent
    GETs: the waits are the daemon's own, never counted against the store."""
    bucket = hostile.bucket()
    hostile.upload_dir(blob, bucket, "m/")
    extra = ["--trust-object-store", "--s3-max-bytes-per-second", str(384 << 10)]
    with (
        serve(tmp_path, hostile, [("remote", f"s3://{bucket}/m/")], extra, ready="remote") as d,
        WeightClient(d.target, timeout=60) as client,
    ):
        same(client.fetch(0, 1), load_file(str(blob / "model.safetensors")))
        # 1 MiB at 384 KiB/s in 256 KiB ranges, 8 at once: each GET far below the
        # 256 KiB/s minimum by the clock, and past its 2 s grace.
        assert d.seconds_between("download phase=start", "download phase=done") > 2


def test_a_retried_listing_is_read_under_the_same_bounds(
    hostile: HostileStore, blob: Path, tmp_path: Path
) -> None:
    """The store's first answer is 503 SlowDown: the SDK retries the same request, which
    is read under the same bounds as the first (a listing stays a bounded page)."""
    bucket = hostile.bucket()
    hostile.upload_dir(blob, bucket, "m/")
    hostile.scenario(bucket, flaky={"failures": 1})
    with (
        serve(
            tmp_path,
            hostile,
            [("remote", f"s3://{bucket}/m/")],
            ["--trust-object-store"],
            ready="remote",
        ) as d,
        WeightClient(d.target, timeout=60) as client,
    ):
        same(client.fetch(0, 1), load_file(str(blob / "model.safetensors")))
        text = scrape(_metrics_url(d.log()))
        assert metric(text, "weightd_source_retries_total") == 1
        assert hostile.stats(bucket)["list"] == 1  # the 503 was answered before counting
