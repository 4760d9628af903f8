r"""Regular expressions from files, matched in linear time: the one engine for them. Pure.

Patterns that come from disk (``adapter_config.json``'s ``target_modules``,
``exclude_modules``, ``layers_pattern``, ``rank_pattern``/``alpha_pattern`` keys;
``--rules`` files; the built-in tables, parsed by the same code) are written for
Python's ``re``, a backtracking engine: ``(a+)+$`` against 28 ``a`` and a ``!`` takes
time exponential in the length, holding the GIL, and the daemon answers nothing
meanwhile. Here they are
compiled with RE2 (``google-re2``), whose matching time is linear in the name.

Keeping Python's meaning, not just its syntax: a pattern is accepted only when

* Python's ``re`` compiles it (so it is one PEFT or a rules author meant), and
* RE2 compiles it (no backreferences, lookaround, atomic groups, possessive or
  huge ``{n}`` repeats, which is what makes it linear), and
* it uses none of the few constructs both accept but read differently: ``{,n}`` (a
  repeat in Python, literal text in RE2), ``[[:alpha:]]`` and other set syntax
  (``[:``, ``--``, ``&&``, ``~~``, ``||`` inside a class), and numeric escapes
  (``\1`` is a backreference or an octal escape depending on the engine and the
  digits).

What still differs is Unicode: Python's ``\d``, ``\w``, ``\s``, ``\b`` and case
folding cover all of Unicode, RE2's ``\d``/``\w``/``\s``/``\b`` only ASCII. Every name
weightd matches comes from a safetensors header, which refuses control characters,
so ``$`` before a final newline never arises; a non-ASCII name matched by a pattern
using one of those constructs raises :class:`UnmatchableName` rather than risk an
answer Python would not give. Anything refused names the file and field it came from.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import re2

from .errors import UnmatchableName, WeightdError

#: Longest pattern accepted, in characters: far above any real one, and it bounds both
#: compiles (RE2 also caps its program memory, below).
MAX_PATTERN_CHARS: Final = 16 << 10
#: RE2's memory for one compiled program (its default is 8 MiB; a big pattern fails).
MAX_PROGRAM_BYTES: Final = 8 << 20

_SET_SYNTAX: Final = ("[:", "[", "--", "&&", "~~", "||")
_CLASS_ESCAPES: Final = frozenset("dDwWsSbB")
#: An inline flag group: ``(?i)``, ``(?si:...)``, ``(?-i:...)``.
_FLAGS: Final = re.compile(r"\(\?[a-zA-Z-]*[:)]")


def _options() -> re2.Options:
    options = re2.Options()
    options.log_errors = False  # a refused pattern is our error to report, not stderr's
    options.max_mem = MAX_PROGRAM_BYTES
    return options


@dataclass(frozen=True, slots=True)
class Match:
    """What a match found: its named groups (all a caller here ever reads)."""

    groups: dict[str, str | None]

    def group(self, name: str) -> str | None:
        return self.groups[name]


@dataclass(frozen=True, slots=True)
class Pattern:
    """One compiled pattern and where it came from (quoted when a name is refused)."""

    text: str
    source: str
    _regexp: re2._Regexp = field(repr=False, compare=False)
    #: Whether ASCII-only classes or case folding could read a non-ASCII name differently.
    _ascii_sensitive: bool = field(repr=False, compare=False)

    @property
    def groupindex(self) -> dict[str, int]:
        return dict(self._regexp.groupindex)

    def search(self, name: str) -> Match | None:
        """``re.search``: the pattern anywhere in ``name``."""
        self._check(name)
        return self._wrap(self._regexp.search(name))

    def match(self, name: str) -> Match | None:
        """``re.match``: the pattern at the start of ``name``."""
        self._check(name)
        return self._wrap(self._regexp.match(name))

    def fullmatch(self, name: str) -> Match | None:
        """``re.fullmatch``: the pattern is the whole of ``name``."""
        self._check(name)
        return self._wrap(self._regexp.fullmatch(name))

    def _check(self, name: str) -> None:
        if self._ascii_sensitive and not name.isascii():
            raise UnmatchableName(
                f"name {name[:120]!r} is not ASCII, and pattern {self.text[:120]!r} from "
                f"{self.source} uses \\d, \\w, \\s, \\b or case folding, which Python's re "
                "and the linear-time engine read differently outside ASCII; refusing to guess"
            )

    @staticmethod
    def _wrap(m: re2._Match | None) -> Match | None:
        return None if m is None else Match(m.groupdict())


def _lexical_problem(pattern: str) -> str | None:
    """A construct both engines accept with different meanings, or None."""
    in_class = False
    start = 0  # where the current class's first member begins
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            nxt = pattern[i + 1 : i + 2]
            if nxt.isdigit():
                return f"numeric escape '\\{nxt}' (a backreference or octal, by engine)"
            i += 2
            continue
        if in_class:
            if ch == "]" and i > start:
                in_class = False
            else:
                for s in _SET_SYNTAX:
                    if pattern.startswith(s, i):
                        return f"set syntax {s!r} inside [...] (read differently by RE2)"
        elif ch == "[":
            in_class = True
            start = i + 1
            if pattern.startswith("^", start):
                start += 1
        elif ch == "{" and pattern.startswith(",", i + 1):
            return "'{,' (a repeat in Python, literal text in RE2)"
        i += 1
    return None


def _ascii_sensitive(pattern: str) -> bool:
    """Conservatively: any class escape or inline flag group (``(?i)`` among them)."""
    i = 0
    while i < len(pattern):
        if pattern[i] == "\\":
            if pattern[i + 1 : i + 2] in _CLASS_ESCAPES:
                return True
            i += 2
        else:
            i += 1
    return _FLAGS.search(pattern) is not None


def compile_pattern(pattern: str, source: str, error: Callable[[str], WeightdError]) -> Pattern:
    """Compile ``pattern`` (from ``source``, e.g. "a.json field 'x'") or raise ``error(why)``.

    ``error`` builds the caller's typed error from the reason, so it names the file
    and field: a rules file raises ``RulesFileError``, an adapter ``AdapterConfigError``.
    """
    if not isinstance(pattern, str):
        raise error(f"must be a regex string, got {type(pattern).__name__}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise error(f"is a {len(pattern)}-character regex; the limit is {MAX_PATTERN_CHARS}")
    # First: Python warns (FutureWarning) on the set syntax this refuses.
    problem = _lexical_problem(pattern)
    if problem is not None:
        raise error(f"{pattern[:200]!r} uses {problem}; write it another way")
    try:
        re.compile(pattern)
    except (re.error, OverflowError, RecursionError) as exc:
        raise error(f"{pattern[:200]!r} is not a valid regex: {exc}") from None
    try:
        compiled = re2.compile(pattern, _options())
    except re2.error as exc:
        reason = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else exc
        raise error(
            f"{pattern[:200]!r} cannot be matched in linear time ({reason}): backreferences, "
            "lookaround, atomic groups, possessive and repeats over {1000} are refused"
        ) from None
    return Pattern(pattern, source, compiled, _ascii_sensitive(pattern))
