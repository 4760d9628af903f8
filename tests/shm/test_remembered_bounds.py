"""What worker clients can make every later load build: the declared layouts plus at
most ``local.max_remembered_layouts`` remembered ones, whatever they asked for.

A real daemon out of process, a client on its worker socket asking for many distinct
layouts over shared memory (each one remembered in the cache directory), then a
restart on the same cache directory and a publish: the daemon's own ``layouts_built``
events say what each load built.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import run_daemon
from weightd.client import AdminClient, Layout, WeightClient
from weightd.server.transports.options import DEFAULT_MAX_REMEMBERED

pytestmark = pytest.mark.e2e

ASKED = 6  # distinct layouts a client asks for (vocab_pad values)


def built_layouts(log: str) -> list[list[str]]:
    """The ``layouts=`` of every ``layouts_built`` event, in order."""
    out = []
    for line in log.splitlines():
        if re.search(r"\blayouts_built\b", line):
            found = re.search(r'layouts=("[^"]*"|\S+)', line)
            assert found is not None, line
            out.append(found.group(1).strip('"').split(";"))
    return out


def test_a_client_asking_many_layouts_never_makes_a_load_build_more_than_the_bound(
    demo_model: Path, tmp_path: Path
) -> None:
    declared = ["--layout", "tp=2"]
    with (
        run_daemon(tmp_path, [("demo", demo_model)], declared) as daemon,
        WeightClient(daemon.target, timeout=120) as client,
    ):
        for i in range(ASKED):
            layout = Layout(tp_size=1, tp_rank=0, vocab_pad=64 * (i + 1))
            client.fetch_layout(layout, model="demo", transport="shm")
    memory = list((tmp_path / "cache" / "layouts").glob("*.json"))
    assert len(memory) == 1 and memory[0].read_text().count('"tp"') >= ASKED
    with run_daemon(tmp_path, [("demo", demo_model)], declared) as daemon:
        with AdminClient(daemon.address("admin"), timeout=120) as admin:
            admin.reload("demo")
        log = daemon.log()
    loads = built_layouts(log)
    assert len(loads) >= 1, log
    for layouts in loads:
        assert layouts[0] == "tp=2", layouts
        assert len(layouts) == 1 + DEFAULT_MAX_REMEMBERED, layouts
    # a remembered layout's packs are not logged as declared ones
    remembered = [ln for ln in log.splitlines() if "pack_built" in ln and "tp1" in ln]
    assert remembered and all("declared=false" in ln for ln in remembered), remembered
