"""The autoload policy's rules, as tables (pure: no daemon, no files)."""

from __future__ import annotations

import pytest

from weightd.server.adapters.autoload import AutoloadPolicy, check_digest, check_pattern
from weightd.server.base.errors import AdapterNotFound, AdapterTrustError, InvalidRequest

D = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("allow", "name", "allowed"),
    [
        ((), "a", False),
        (("a",), "a", True),
        (("a",), "ab", False),
        (("a*",), "ab", True),
        (("a*",), "a", True),
        (("a*",), "ba", False),
        (("*",), "anything", True),
        (("x", "y-*"), "y-1", True),
    ],
)
def test_allows(allow: tuple[str, ...], name: str, allowed: bool) -> None:
    assert AutoloadPolicy(allow).allows(name) is allowed


@pytest.mark.parametrize(
    ("policy", "name", "outcome"),
    [
        (AutoloadPolicy(("a",), {"a": D}), "a", D),
        (AutoloadPolicy(("a",), {}, trust_roots=True), "a", None),
        (AutoloadPolicy(("*",), {"b": D}, trust_roots=True), "b", D),  # a pin still holds
        (AutoloadPolicy(("a",), {}), "a", AdapterTrustError),
        (AutoloadPolicy(("a",), {"b": D}, trust_roots=True), "b", AdapterNotFound),
        (AutoloadPolicy(("*",), trust_roots=True), "../a", InvalidRequest),
        (AutoloadPolicy(("*",), trust_roots=True), ".a", InvalidRequest),
        (AutoloadPolicy(("*",), trust_roots=True), "a/b", InvalidRequest),
        (AutoloadPolicy(("*",), trust_roots=True), "a\\b", InvalidRequest),
        (AutoloadPolicy(("*",), trust_roots=True), "a\nb", InvalidRequest),
    ],
)
def test_expected_digest(policy: AutoloadPolicy, name: str, outcome: object) -> None:
    if isinstance(outcome, type):
        with pytest.raises(outcome):
            policy.expected_digest(name)
    else:
        assert policy.expected_digest(name) == outcome


@pytest.mark.parametrize("pattern", ["a", "a*", "*", "a-b.c_d*"])
def test_good_patterns(pattern: str) -> None:
    assert check_pattern(pattern) == pattern


@pytest.mark.parametrize("pattern", ["", "**", "a*b", "*a", "a/b*", "../x", ".x*"])
def test_bad_patterns(pattern: str) -> None:
    with pytest.raises(ValueError):
        check_pattern(pattern)


@pytest.mark.parametrize("text", ["sha256:" + "0" * 63, "sha256:" + "A" * 64, "blake3:" + "0" * 64])
def test_bad_digests(text: str) -> None:
    with pytest.raises(ValueError):
        check_digest(text)
