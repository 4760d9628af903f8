"""Every malformed input of the corpus, through the library, ``weightd verify`` and
``weightd serve``.

Each case asserts: the first problem is exactly the expected type; its message names
the file and the tensor or field; ``weightd verify`` exits non-zero printing that
problem; ``weightd serve`` refuses with exactly one error line and no traceback.

Both commands run in process (``cli.main``: the same code path minus interpreter
start-up, which costs ~1 s a process on these machines) for every case, and out of
process (a real ``python -m weightd.server.cli.main``) for one case of each family. Set
``WEIGHTD_CORPUS_SUBPROCESS=all`` to run every case out of process too.
"""

from __future__ import annotations

import collections
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import weightd_command
from tests.trust.corpus import CASES, Case, Keys, Setup
from weightd.server.cli import main as cli
from weightd.server.trust.verify import VerifyOptions, verify_checkpoint

pytestmark = pytest.mark.timeout(120)

_FIRST_OF_FAMILY = {c.id for c in {c.family: c for c in reversed(CASES)}.values()}
_ALL_OUT_OF_PROCESS = os.environ.get("WEIGHTD_CORPUS_SUBPROCESS") == "all"


def test_corpus_size_and_coverage() -> None:
    families = collections.Counter(c.family for c in CASES)
    assert len(CASES) >= 45
    assert set(families) == {
        "header",
        "index",
        "path",
        "config",
        "manifest",
        "signature",
        "hfcache",
    }
    assert len({c.id for c in CASES}) == len(CASES)
    assert len({c.error for c in CASES}) >= 35  # rule families have their own types


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    from weightd.server.trust.signing import generate_keypair

    d = tmp_path_factory.mktemp("keys")
    generate_keypair(str(d / "k"), str(d / "k.pub"))
    generate_keypair(str(d / "other"), str(d / "other.pub"))
    return Keys(d / "k", d / "k.pub", d / "other", d / "other.pub")


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short directory for a Unix socket path (sun_path holds 107 bytes)."""
    with tempfile.TemporaryDirectory(prefix="wdc-", dir="/tmp") as d:
        yield Path(d)


def _options(setup: Setup) -> VerifyOptions:
    return VerifyOptions(
        manifests={"": str(setup.manifest)} if setup.manifest else {},
        trust_keys=tuple(str(k) for k in setup.trust_keys),
        trust_hf_cache=setup.hf,
        progress=False,
    )


def _serve_args(setup: Setup, sock_dir: Path) -> list[str]:
    return [
        "serve",
        "--model",
        str(setup.model),
        "--listen",
        f"unix://{sock_dir}/s.sock",
        "--cache-dir",
        str(sock_dir / "cache"),
        *setup.cli_args(),
    ]


def _one_error_line(stderr: str, command: str) -> str:
    lines = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"weightd {command}: error: "), stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.family}-{c.id}")
def test_malformed_input(
    case: Case,
    keys: Keys,
    tmp_path: Path,
    short_tmp: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    try:
        setup = case.build(tmp_path, keys)
    except PermissionError as exc:  # mknod without CAP_MKNOD
        pytest.skip(f"cannot build this case here: {exc}")

    # 1. The library: the exact type, first; the message names file and tensor/field.
    v = verify_checkpoint(str(setup.model), None, _options(setup))
    v.store.close()
    assert not v.ok and v.problems
    first = v.problems[0]
    message = str(first)
    assert type(first) is case.error, f"{type(first).__name__}: {message}"
    assert case.file in message, message
    assert case.what in message, message

    # 2. weightd verify: non-zero, the problem on its own line.
    rc = cli.main(["verify", str(setup.model), *setup.cli_args()])
    out, err = capsys.readouterr()
    assert rc == 1, out + err
    assert f"problem: {message}" in out.splitlines(), out
    assert out.splitlines()[-1].startswith("FAILED: ")
    assert "Traceback" not in out + err

    # 3. weightd serve: refuses with one line naming the same problem.
    rc = cli.main(_serve_args(setup, short_tmp))
    _, err = capsys.readouterr()
    assert rc == 1
    line = _one_error_line(err, "serve")
    assert message in line, line

    # 4. The same two commands as real processes (a sample, or all on request).
    if case.id in _FIRST_OF_FAMILY or _ALL_OUT_OF_PROCESS:
        done = subprocess.run(
            weightd_command("verify", str(setup.model), *setup.cli_args()),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 1, done.stdout + done.stderr
        assert f"problem: {message}" in done.stdout.splitlines()
        assert "Traceback" not in done.stdout + done.stderr
        done = subprocess.run(
            weightd_command(*_serve_args(setup, short_tmp)),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 1, done.stderr
        assert message in _one_error_line(done.stderr, "serve")
