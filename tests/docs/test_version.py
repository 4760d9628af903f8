"""One version, declared once (pyproject.toml), and the files that must agree with it.

The code reads it from the installed distribution's metadata (``weightd --version``,
the daemon's ``start`` log line and ``weightd_build_info``); what cannot read it (the
image tag in deploy/, the changelog) is checked against it here. Also: the LICENSE
file is the Apache License 2.0 that pyproject.toml declares, word for word.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
#: SHA-256 of the Apache License 2.0 text as the ASF publishes it (LICENSE-2.0.txt).
APACHE_2_SHA256 = "c71d239df91726fc519c6eb72d318ec65820627232b2f796219e87dcf35d0ab4"


def declared() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def test_the_version_is_0_x_and_the_installed_metadata_says_the_same() -> None:
    version = declared()
    assert re.fullmatch(r"0\.\d+\.\d+", version), version
    assert metadata.version("weightd") == version, "reinstall: pip install -e ."
    out = subprocess.run(
        [sys.executable, "-m", "weightd.server.cli.main", "--version"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert out.strip() == f"weightd {version}"


def test_no_other_file_hard_codes_another_version() -> None:
    version = declared()
    tags = []
    for path in sorted((ROOT / "deploy").rglob("*")):
        if path.is_file():
            tags += [
                (path, t) for t in re.findall(r"\bweightd:(\d+\.\d+\.\d+)\b", path.read_text())
            ]
    assert tags, "deploy/ names the image weightd:<version>"
    assert all(t == version for _, t in tags), [(str(p), t) for p, t in tags if t != version]
    for folder in ("client/weightd", "server/weightd"):
        for path in (ROOT / folder).rglob("*.py"):
            # A package version written in code (``__version__ = ...``, ``version="0.1"``);
            # a model's weight version (``weight_version="7"``) is no such thing.
            text = path.read_text()
            assert not re.search(r"__version__\s*=|\bversion\s*=\s*['\"]\d+\.\d", text), path


def test_the_changelog_has_the_declared_version() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in text
    assert re.search(rf"^## \[{re.escape(declared())}\] - \d{{4}}-\d{{2}}-\d{{2}}$", text, re.M)


def test_license_is_the_full_apache_2_text() -> None:
    text = (ROOT / "LICENSE").read_bytes()
    assert hashlib.sha256(text).hexdigest() == APACHE_2_SHA256
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == "Apache-2.0"
