"""Docstrings and comments say why, and never quote one machine's timings.

A figure measured on the development VM ("~1.8 GB/s here", "took 16 s") goes stale
with the next machine or the next change, and reads as a promise. Figures belong in a
dated note under ``docs/notes/`` with the command that produced them; code links there.
This test reads every comment and docstring of the daemon, the client and the
benchmarks and refuses throughput figures, speed-up ratios, and timings stated as
measured.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("server/weightd", "client/weightd", "bench")
GENERATED = "client/weightd/v1"

#: Always a measurement: a throughput, a cost per byte, a speed-up.
_ALWAYS = re.compile(
    r"\d(\.\d+)?\s*(GB|MB|GiB|MiB|KB|kB)/s\b"
    r"|\d(\.\d+)?\s*(CPU-)?s\s*/\s*G(i)?B\b|CPU-s\b"
    r"|\d(\.\d+)?\s*[x\u00d7]\s+(faster|slower|cheaper|bare)\b"
)
#: A time, which is a measurement when the same line says it was measured here.
_TIME = re.compile(r"\d(\.\d+)?\s*(ns|µs|us|ms|s)\b")
_MEASURED = re.compile(r"\b(here|measured|this (VM|machine)|took|takes)\b", re.IGNORECASE)


def texts(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment and docstring line in ``path``."""
    source = path.read_text()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                value = body[0].value.value
                if isinstance(value, str):
                    for i, line in enumerate(value.splitlines()):
                        yield body[0].lineno + i, line


def offending(text: str) -> bool:
    return bool(_ALWAYS.search(text)) or bool(_TIME.search(text) and _MEASURED.search(text))


def sources() -> list[Path]:
    out = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if not str(path.relative_to(ROOT)).startswith(GENERATED):
                out.append(path)
    return out


@pytest.mark.parametrize(
    ("text", "flagged"),
    [
        ("# hashing runs at ~1.8 GB/s per core", True),
        ("cut the client's CPU per GB by 0.2-0.4 s/GB", True),
        ("BLAKE3 is ~4x faster per core", True),
        ("# the last rank's median took 6.6 ms", True),
        ("costs ~0.25 s per GiB here", True),
        ("# default 30 s, then the stream is cancelled", False),
        ("each message carries at most 1 MiB", False),
        ("``stat``'s clock ticks are 10 ms", False),
    ],
)
def test_the_rule(text: str, flagged: bool) -> None:
    assert offending(text) is flagged


def test_no_measured_figures_in_docstrings_or_comments() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {text.strip()}"
        for path in sources()
        for line, text in texts(path)
        if offending(text)
    ]
    assert not found, "move these figures to a dated note in docs/notes/:\n" + "\n".join(found)
