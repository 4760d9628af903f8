"""Coverage-guided fuzzing of the header, index, manifest, signature-envelope and
adapter-config parsers, bounded for CI; every crasher found is a regression input.

Each target runs in its own process (libFuzzer exits when it is done) for a few
thousand executions from real seed files; the run must end without a crasher (an
exception other than a typed, file-naming ``WeightdError``). Longer runs:
``python -m tests.reliability.fuzz <target> --seconds N`` (see that module).
The hypothesis property tests in ``tests/trust/test_fuzz.py`` mutate JSON
structurally; this harness mutates bytes, guided by the parsers' coverage.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reliability import fuzz, fuzz_targets
from tests.reliability.fuzz_targets import TARGETS, regressions, seeds

RUNS = 3000


@pytest.mark.parametrize("target", fuzz.NAMES)
def test_bounded_fuzz_run_finds_no_crasher(target: str, tmp_path: Path) -> None:
    artifacts = tmp_path / "artifacts"
    scratch = tmp_path / "tmp"  # the run's temporary directory: left empty afterwards
    scratch.mkdir()
    command = [sys.executable, "-m", "tests.reliability.fuzz", target, f"--runs={RUNS}"]
    done = subprocess.run(
        [*command, f"--artifacts={artifacts}", "--seed=7"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, TMPDIR=str(scratch)),
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert not list(scratch.iterdir()), "the fuzz run left its work directory behind"
    assert not artifacts.exists() or not any(artifacts.iterdir()), out[-4000:]
    executed = re.search(r"number_of_executed_units: (\d+)|#(\d+) DONE builtin", out)
    assert executed is not None, out[-2000:]
    assert int(executed.group(1) or executed.group(2)) >= RUNS
    print(f"{target}: {executed.group(0)}")


@pytest.mark.parametrize("target", fuzz.NAMES)
def test_real_seeds_are_accepted(target: str) -> None:
    """Seeds are valid inputs (a fuzzer starting from rejected files explores little)."""
    parse = {
        "header": lambda d: fuzz_targets.parse_header(
            "s", d[8 : 8 + fuzz_targets.header_length("s", d[:8], len(d))], len(d)
        ),
        "index": lambda d: fuzz_targets.parse_index("/m", d),
        "manifest": lambda d: fuzz_targets.parse_manifest("/m/x.json", d),
        "signature": lambda d: fuzz_targets.check_signature(
            fuzz_targets.parse_manifest("/m/x.json", d),
            [fuzz_targets.load_public_key(str(fuzz_targets.SEEDS / "signature.pub"))],
        ),
        "adapter_config": lambda d: fuzz_targets.parse_adapter_config("/a/c.json", d),
    }[target]
    found = seeds(target)
    assert found
    for data in found:
        parse(data)  # no exception at all


@pytest.mark.parametrize(
    "path",
    [p for t in fuzz.NAMES for p in regressions(t)],
    ids=lambda p: f"{p.parent.name}/{p.name}",
)
def test_regression_inputs(path: Path) -> None:
    """Every crasher ever found, replayed: now a typed error or accepted."""
    TARGETS[path.parent.name](path.read_bytes())


def test_targets_and_names_agree() -> None:
    assert tuple(TARGETS) == fuzz.NAMES
    assert {p.name for p in fuzz_targets.REGRESSIONS.iterdir() if p.is_dir()} <= set(fuzz.NAMES)


def test_the_harness_reports_a_crasher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An untyped exception, or a typed one not naming its file, is a crasher."""

    def buggy(data: bytes) -> None:
        if b"weight_map" in data:
            raise KeyError("weight_map")

    monkeypatch.setitem(TARGETS, "index", buggy)
    assert fuzz.run_builtin("index", 50, 0, 1, tmp_path) == 1
    (crash,) = tmp_path.iterdir()
    assert b"weight_map" in crash.read_bytes()

    from weightd.server.base.errors import IndexSchemaError

    def vague(data: bytes) -> None:
        try:
            raise IndexSchemaError("somewhere", "bad")
        except IndexSchemaError as exc:
            fuzz_targets._typed(exc, "/m/model.safetensors.index.json")

    with pytest.raises(fuzz_targets.Crash):
        vague(b"")
