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
from weightd.client.admin import AdminClient

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
        # Each hostile model ended within its bound: grace 2 s + one range at the minimum
        # rate (1 s), the listing's 10 s; all of them loaded at once.
        assert d.seconds_between("start pid=", "serving models=local") < 30
        text = scrape(_metrics_url(d.log()))
        assert metric(text, "weightd_model_state", {"model": "drip", "state": "failed"}) == 1
        assert metric(text, "weightd_model_state", {"model": "local", "state": "ready"}) == 1
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
    from tests.conftest import listening_address

    url = listening_address(log, "metrics")
    assert url is not None
    return url
