"""What one worker-socket client can make the daemon keep through holds, end to end.

A real daemon out of process with its default bounds, a hoarding client on the same
worker socket as an engine (the real client, over gRPC), real checkpoints published
one after the other. The hoarder holds every version as hard as it can; the engine
must still get its hold, and the daemon must keep at most ``versions.max_old`` older
versions, saying so in its metrics.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import RunningDaemon, run_daemon
from tests.versions.test_versions_e2e import admin_of, scrape, versions  # noqa: F401
from weightd.client import WeightClient
from weightd.server.registry.holdbounds import HoldBounds

pytestmark = pytest.mark.e2e

BOUNDS = HoldBounds()


@pytest.fixture
def daemon(tmp_path: Path, versions: dict[str, Path]) -> Iterator[RunningDaemon]:  # noqa: F811
    with run_daemon(tmp_path, [("m", versions["v1"])], ["--metrics-listen", "127.0.0.1:0"]) as d:
        yield d


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert found is not None, name
    return float(found.group(1))


def test_a_hoarder_keeps_a_bounded_number_of_versions_and_never_stops_an_engine(
    daemon: RunningDaemon,
    versions: dict[str, Path],  # noqa: F811
) -> None:
    order = ["v2", "v3", "v1", "v2", "v3"]
    with (
        WeightClient(daemon.target, timeout=60) as hoarder,
        WeightClient(daemon.target, timeout=60) as engine,
        admin_of(daemon) as admin,
    ):
        one_version = hoarder.describe("m").total_bytes
        per_version = BOUNDS.max_holds_per_client // (len(order) + 1)
        for name in order:
            for i in range(per_version):
                hoarder.hold_version("m", 0, holder=f"hoarder-{i}", ttl=3600)
            admin.publish(str(versions[name]), model="m")
        text = scrape(daemon)
        assert metric(text, 'weightd_model_versions_held{model="m"}') == BOUNDS.max_old + 1
        old = metric(text, 'weightd_model_old_versions_bytes{model="m"}')
        assert old == BOUNDS.max_old * one_version
        assert metric(text, "weightd_model_versions_evicted_total") == len(order) - BOUNDS.max_old
        # more holds than the daemon keeps in all, each under a fresh holder name
        for i in range(BOUNDS.max_holds + 10):
            hoarder.hold_version("m", 0, holder=f"h{i}", ttl=3600)
        current = admin.publish(str(versions["v1"]), model="m").version
        hold = engine.hold_version("m", current, holder="vllm-engine", ttl=60)
        assert hold.version == current
        text = scrape(daemon)
        assert metric(text, 'weightd_model_versions_held{model="m"}') <= BOUNDS.max_old + 1
        assert metric(text, "weightd_version_holds_evicted_total") > BOUNDS.max_holds // 2
        counts = re.findall(r"^weightd_model_version_holds\{[^}]*\} (\S+)$", text, re.M)
        holds = sum(float(v) for v in counts)
        assert holds <= BOUNDS.max_holds_per_client
        assert hold.release()
    assert "ended early to make room" in daemon.log()
