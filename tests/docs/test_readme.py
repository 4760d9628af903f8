"""The README stays a short front page whose links all lead somewhere.

Its detailed content lives on the documentation site; what stays is what weightd is,
the two quick-start commands, the five-minute path to vLLM, and links. Every relative
link must name a file or folder that exists (and a heading that exists, for a link
into a Markdown page), and no install instruction may pretend weightd is on a package
index.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.docs.markdown import heading_ids, links

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 250


def test_the_readme_is_short() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


def test_every_relative_link_resolves() -> None:
    text = README.read_text()
    problems = []
    found = links(text)
    assert len(found) > 20, "the README links its guides, design pages, notes and examples"
    for target in found:
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        where = README if not path else (ROOT / path)
        if not where.exists():
            problems.append(f"{target}: no such file")
            continue
        if anchor and where.suffix == ".md" and anchor not in heading_ids(where.read_text()):
            problems.append(f"{target}: no heading with id {anchor!r} in {path or 'README.md'}")
    assert not problems, "\n".join(problems)


def test_the_quick_start_commands_are_the_ones_that_exist() -> None:
    text = README.read_text()
    for command, script in (
        ("bash deploy/demo.sh", "deploy/demo.sh"),
        ("bash .ci/test.sh", ".ci/test.sh"),
    ):
        assert command in text
        assert (ROOT / script).is_file()


def test_no_install_from_a_package_index_and_no_missing_pages() -> None:
    for path in [README, *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text()
        # `pip install weightd` / `pip install 'weightd[s3]'` would fetch from an index
        # that has no such package; from a clone it is `pip install .` / `".[s3]"`.
        assert not re.search(r"pip install +['\"]?weightd\b", text), path
        assert "VLLM.md" not in text, f"{path}: links a file that is not in the repository"


def test_the_object_store_bounds_it_states_are_the_codes() -> None:
    """The README states the object-store bounds (issue 37); ``sources/bounds.py`` holds
    them. A bound changed in the code without the README fails here."""
    from weightd.server.sources import bounds as b

    text = " ".join(README.read_text().split())
    stated = {
        f"{b.MAX_LIST_KEYS:,} keys": "MAX_LIST_KEYS",
        f"{b.MAX_LIST_PAGES} pages ({b.MAX_EMPTY_PAGES} empty in a row)": "pages",
        f"{b.MAX_LIST_BYTES >> 20} MiB and `s3.list_seconds` ({b.DEFAULT_LIST_SECONDS:g} s)": (
            "listing bytes and time"
        ),
        f"`s3.request_seconds` ({b.DEFAULT_REQUEST_SECONDS:g} s)": "request_seconds",
        f"`s3.min_bytes_per_second` ({b.DEFAULT_MIN_BYTES_PER_SECOND >> 10} KiB/s)": "rate",
        f"`s3.rate_grace_seconds` ({b.DEFAULT_RATE_GRACE_SECONDS:g} s)": "grace",
    }
    missing = [f"{what}: {phrase!r}" for phrase, what in stated.items() if phrase not in text]
    assert not missing, "README.md does not state these bounds as the code has them: " + (
        "; ".join(missing)
    )
