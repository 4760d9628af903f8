"""The linear-time engine for patterns from files: Python's meaning, RE2's running time.

Every accepted pattern must give exactly Python's ``re`` answer (match or not, and the
named groups) on the names weightd matches; what cannot be proven so is refused with
the file and field in the message.
"""

from __future__ import annotations

import re
import time

import pytest

from weightd.server.base.errors import RulesFileError, UnmatchableName
from weightd.server.base.patterns import compile_pattern


def _error(why: str) -> RulesFileError:
    return RulesFileError("mine.json", f"rules[0].match {why}")


#: Patterns of the kinds files hold: PEFT target regexes, rank_pattern keys wrapped the
#: way PEFT wraps them, layers patterns, the built-in tables' and rules files' rules.
PATTERNS = [
    r".*\.(q_proj|v_proj)",
    r"model\.layers\.\d+\.self_attn\.(q|k|v)_proj",
    r".*[^x]q_proj",
    r"(.*\.)?(q_proj)$",
    r"(.*\.)?(layers\.1\..*)$",
    r"(?:^|.*?\.)layers\.(?P<idx>\d+)\.",
    r".*?\.[^.]*\.(?P<idx>\d+)\.",
    r"(?:^|\.)layers\.(?P<layer>\d+)\.",
    r"\.experts\.(?P<expert>\d+)\.w1\.weight$",
    r"(^|\.)embed_tokens\.weight$",
    r"^lm_head\.weight$",
    r"(?i)Q_PROJ$",
    r"(?i:layers)\.0\.",
    r"[]a.]+",
    r"[^]x]+proj",
    r"q_proj|",
    r"a{2,3}",
    r"a{2,}",
    r"x{0}y",
    r"\bq_proj\b",
    r"\Aq",
    r"(a+)+$",
    r"(?s).*proj",
    r"(?m)proj$",
    r"[\w.]+\.weight",
    r"\S+\s*",
    r"[a-c\-]+",
    r"\.",
    r"\x2e(q)",
]
NAMES = [
    "",
    "q_proj",
    "model.layers.0.self_attn.q_proj",
    "model.layers.12.self_attn.v_proj",
    "model.layers.1.mlp.down_proj",
    "model.layers.3.experts.7.w1.weight",
    "model.embed_tokens.weight",
    "lm_head.weight",
    "xq_proj",
    "a.q_proj.b",
    "aaa",
    "a" * 12 + "!",  # (short: Python backtracks 2**n steps on "(a+)+$")
    "model.LAYERS.0.q_proj",
    "]a.a",
    "layers.5.x",
    "proj",
    "y",
]


def _py(pattern: str, name: str, how: str) -> dict[str, str | None] | None:
    m = getattr(re.compile(pattern), how)(name)
    return None if m is None else m.groupdict()


@pytest.mark.parametrize("pattern", PATTERNS)
def test_accepted_patterns_answer_exactly_as_python(pattern: str) -> None:
    p = compile_pattern(pattern, "mine.json rules[0].match", _error)
    for name in NAMES:
        for how in ("search", "match", "fullmatch"):
            got = getattr(p, how)(name)
            want = _py(pattern, name, how)
            assert (None if got is None else got.groups) == want, (pattern, name, how)


REFUSED = [
    (r"(a)\1", "numeric escape"),
    (r"\012", "numeric escape"),
    (r"(?P<x>a)(?P=x)", "cannot be matched in linear time"),
    (r"q(?=_proj)", "cannot be matched in linear time"),
    (r"(?<!x)q_proj", "cannot be matched in linear time"),
    (r"(?>a+)b", "cannot be matched in linear time"),
    (r"a*+", "cannot be matched in linear time"),
    (r"a{1001}", "cannot be matched in linear time"),
    (r"(a{1000}){1000}", "cannot be matched in linear time"),
    (r"a{4294967296}", "is not a valid regex"),
    ("(" * 3000 + ")" * 3000, "is not a valid regex"),
    (r"a{,3}", "'{,'"),
    (r"[[:alpha:]]", "set syntax '[:'"),
    (r"[a--b]", "set syntax '--'"),
    (r"[", "is not a valid regex"),
    (r"(?x) q", "cannot be matched in linear time"),
    ("a" * 20_000, "the limit is"),
]


@pytest.mark.parametrize(("pattern", "needle"), REFUSED, ids=[r[1][:20] for r in REFUSED])
def test_what_cannot_be_matched_identically_is_refused_naming_the_field(
    pattern: str, needle: str
) -> None:
    with pytest.raises(RulesFileError) as info:
        compile_pattern(pattern, "mine.json rules[0].match", _error)
    text = str(info.value)
    assert text.startswith("mine.json: rules[0].match "), text
    assert needle in text, text
    assert len(text) < 700  # a huge pattern is quoted cut short


def test_catastrophic_pattern_runs_in_linear_time() -> None:
    """Python's re takes ~16 s for this (2x per extra 'a'); RE2 answers at once. The bound
    is a correctness bound, 100x above what it takes, not a benchmark."""
    p = compile_pattern("(a+)+$", "cfg target_modules", _error)
    started = time.monotonic()
    for n in (28, 64, 4096):
        assert p.fullmatch("a" * n + "!") is None
        assert p.search("a" * n + "!") is None
    assert time.monotonic() - started < 5


def test_non_ascii_names_are_refused_where_classes_differ() -> None:
    # Python's \w matches 'é', RE2's does not: refused rather than answered differently.
    p = compile_pattern(r"\w+\.weight", "mine.json rules[2].match", _error)
    with pytest.raises(UnmatchableName, match=r"mine.json rules\[2\].match"):
        p.search("modèle.weight")
    assert p.search("model.weight") is not None
    # Without such classes, non-ASCII names are matched, and as Python would.
    q = compile_pattern(r".*è.*\.weight$", "x", _error)
    assert q.search("modèle.weight") is not None
    assert re.search(r".*è.*\.weight$", "modèle.weight") is not None
    with pytest.raises(UnmatchableName):
        compile_pattern(r"(?i)modÈle", "x", _error).search("modèle")
