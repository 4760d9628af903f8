"""Two worker processes fetching the same rank share its pages (measured with smaps_rollup).

Each worker warms up (client, channel, torch kernels), reads /proc/self/smaps_rollup,
then fetches, touches every byte of its tensors and reads it again while both still
hold them. Over shared memory a
worker's *private* memory grows by a small fraction of the payload (its page tables,
Python objects), and its PSS by about a third (the pages are split between the two
workers and the daemon, which mapped them to verify them). Over gRPC, for contrast,
each worker's private memory grows by at least the whole payload: the measurement can
tell the difference.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import RunningDaemon, run_daemon
from tests.shm.procs import Worker

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def daemon(big_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    with run_daemon(tmp_path_factory.mktemp("sharing"), [("big", big_model)]) as d:
        yield d


def _private(smaps: dict[str, int]) -> int:
    return (smaps["Private_Clean"] + smaps["Private_Dirty"]) * 1024


def _measure(daemon: RunningDaemon, transport: str) -> tuple[int, list[dict[str, int]]]:
    with Worker() as a, Worker() as b:
        workers = (a, b)
        for w in workers:  # warm up: client, channel, torch ops; only then measure
            w.ok(
                "fetch",
                target=daemon.target,
                rank=1,
                world_size=2,
                transport=transport,
                names=["model.norm.weight"],
            )
            w.ok("touch")
            w.ok("drop")
        before = [w.ok("smaps")["smaps"] for w in workers]
        payloads = []
        for w in workers:
            reply = w.ok("fetch", target=daemon.target, rank=0, world_size=2, transport=transport)
            assert reply["transport"] == transport
            payloads.append(reply["nbytes"])
            w.ok("touch")
        after = [w.ok("smaps")["smaps"] for w in workers]  # both still hold their tensors
    assert payloads[0] == payloads[1]
    deltas = [
        {
            "private_bytes": _private(y) - _private(x),
            "pss_bytes": (y["Pss"] - x["Pss"]) * 1024,
            "rss_bytes": (y["Rss"] - x["Rss"]) * 1024,
        }
        for x, y in zip(before, after, strict=True)
    ]
    return payloads[0], deltas


def test_two_workers_share_one_copy(daemon: RunningDaemon) -> None:
    payload, shm = _measure(daemon, "shm")
    _, grpc = _measure(daemon, "grpc")
    print(f"\npayload {payload / 1e6:.1f} MB per worker")
    for label, deltas in (("shm", shm), ("grpc", grpc)):
        for i, d in enumerate(deltas):
            print(
                f"  {label} worker {i}: private +{d['private_bytes'] / 1e6:.1f} MB, "
                f"PSS +{d['pss_bytes'] / 1e6:.1f} MB, RSS +{d['rss_bytes'] / 1e6:.1f} MB"
            )
    assert payload > 25e6  # tens of MB: the signal is not noise
    for d in shm:
        assert d["rss_bytes"] >= 0.9 * payload  # every page was really touched ...
        assert d["private_bytes"] < 0.1 * payload  # ... but none of it is private
        assert d["pss_bytes"] < 0.6 * payload  # shared three ways (two workers, daemon)
    for d in grpc:
        assert d["private_bytes"] >= 0.9 * payload  # each gRPC worker holds its own copy


@pytest.mark.parametrize("populate", [False, True])
def test_populate_maps_every_page_at_fetch_and_copies_none(
    daemon: RunningDaemon, populate: bool
) -> None:
    """``populate=True``: the fetch returns with the rank resident (RSS grows by about the
    payload before anything is read) and anonymous memory does not (no page was copied:
    read faults only); lazily (the default), RSS grows only when read. Either way
    the bytes are the rank's, bit for bit (the digests match a gRPC fetch's)."""
    with Worker() as w:
        args = {"target": daemon.target, "rank": 1, "world_size": 2}
        w.ok("fetch", **args, transport="shm", names=["model.norm.weight"], populate=populate)
        w.ok("touch")
        w.ok("drop")
        before = w.ok("smaps")["smaps"]
        reply = w.ok("fetch", **args, transport="shm", populate=populate)
        mapped = w.ok("smaps")["smaps"]
        got = w.ok("digests")["digests"]
        w.ok("drop")
        w.ok("fetch", **args, transport="grpc")
        want = w.ok("digests")["digests"]
    payload = reply["nbytes"]
    resident = (mapped["Rss"] - before["Rss"]) * 1024
    # A page copied on write would be anonymous memory; the pack's pages are shmem. (Not
    # Private_*: a pack page mapped by this worker alone, the daemon having built it
    # through a writer it unmapped, counts as private although nothing was copied.)
    private = (mapped["Anonymous"] - before["Anonymous"]) * 1024
    assert got == want
    if populate:
        assert resident > 0.9 * payload, (resident, payload)
    else:
        assert resident < 0.5 * payload, (resident, payload)
    assert private < 0.1 * payload, (private, payload)
