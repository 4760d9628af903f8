"""What a config value may be, and how it is read from text and from TOML (pure).

A setting arrives in one of three forms: text (a command-line flag or a ``WEIGHTD_*``
environment variable), a TOML value (the ``--config`` file), or the default. Each
:class:`Kind` reads the first two into the one Python value the daemon uses, and
writes that value back as TOML for ``weightd config show``. A problem is a
:class:`KindError` carrying only *what* is wrong; the loader adds *where* (the flag,
the variable or the file's key), so every message names its source.

TOML is read strictly: a string where a number belongs is refused, not converted,
because a quoted ``"16"`` in a file is a mistake worth one line; text (flags and
environment) is converted, because text is all a shell can pass.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Generic, TypeVar

T = TypeVar("T")


class KindError(ValueError):
    """A value that does not fit its kind; the message says what was expected."""


#: Binary and decimal size suffixes a byte count may carry ("64MiB", "1GB").
_SIZE_UNITS: Final = {
    "": 1,
    "B": 1,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
}
_SIZE: Final = re.compile(r"\s*([0-9]+)\s*([A-Za-z]*)\s*")
_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off"})


def _show(value: object) -> str:
    """``value`` as a TOML value would be written, cut short: for error messages."""
    text = json.dumps(value) if isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class Kind(Generic[T]):
    """How one setting is read and written. ``name`` is what messages call it."""

    name: ClassVar[str] = "a value"

    def from_text(self, text: str) -> T:
        raise NotImplementedError

    def from_toml(self, value: Any) -> T:
        raise NotImplementedError

    def to_toml(self, value: T) -> str:
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


@dataclass(frozen=True)
class Text(Kind[str]):
    name: ClassVar[str] = "a string"

    def from_text(self, text: str) -> str:
        return text

    def from_toml(self, value: Any) -> str:
        if not isinstance(value, str):
            raise KindError(f"expected {self.name}, got {_show(value)}")
        return value

    def to_toml(self, value: str) -> str:
        return json.dumps(value)


@dataclass(frozen=True)
class Choice(Text):
    choices: tuple[str, ...] = ()

    def _check(self, value: str) -> str:
        if value not in self.choices:
            raise KindError(f"expected one of {', '.join(self.choices)}, got {_show(value)}")
        return value

    def from_text(self, text: str) -> str:
        return self._check(text)

    def from_toml(self, value: Any) -> str:
        return self._check(super().from_toml(value))

    def describe(self) -> str:
        return f"one of {', '.join(self.choices)}"


@dataclass(frozen=True)
class Flag(Kind[bool]):
    name: ClassVar[str] = "true or false"

    def from_text(self, text: str) -> bool:
        lowered = text.strip().lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise KindError(f"expected true/false (1/0, yes/no, on/off), got {_show(text)}")

    def from_toml(self, value: Any) -> bool:
        if not isinstance(value, bool):
            raise KindError(f"expected true or false, got {_show(value)}")
        return value

    def to_toml(self, value: bool) -> str:
        return "true" if value else "false"


@dataclass(frozen=True)
class Integer(Kind[int]):
    name: ClassVar[str] = "an integer"

    def from_text(self, text: str) -> int:
        try:
            return int(text.strip(), 10)
        except ValueError:
            raise KindError(f"expected {self.name}, got {_show(text)}") from None

    def from_toml(self, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise KindError(f"expected {self.name}, got {_show(value)}")
        return value

    def to_toml(self, value: int) -> str:
        return str(value)


@dataclass(frozen=True)
class ByteSize(Integer):
    """A byte count: an integer, or text with a unit (``64MiB``, ``1GiB``, ``10GB``)."""

    name: ClassVar[str] = "a byte count (integer, or with a unit: 64MiB, 1GiB, 10GB)"

    def from_text(self, text: str) -> int:
        m = _SIZE.fullmatch(text)
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _SIZE_UNITS:
            raise KindError(f"expected {self.name}, got {_show(text)}")
        return int(m.group(1)) * _SIZE_UNITS[unit]

    def from_toml(self, value: Any) -> int:
        if isinstance(value, str):
            return self.from_text(value)
        return super().from_toml(value)

    def describe(self) -> str:
        return "bytes (an integer, or 64MiB, 1GiB, 10GB)"


@dataclass(frozen=True)
class Seconds(Kind[float]):
    """A finite number of seconds (an integer is accepted; NaN and infinities are not)."""

    name: ClassVar[str] = "a number of seconds"

    def _finite(self, value: float, shown: object) -> float:
        if not math.isfinite(value):
            raise KindError(f"expected a finite {self.name[2:]}, got {_show(shown)}")
        return value

    def from_text(self, text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise KindError(f"expected {self.name}, got {_show(text)}") from None
        return self._finite(value, text)

    def from_toml(self, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise KindError(f"expected {self.name}, got {_show(value)}")
        return self._finite(float(value), value)

    def to_toml(self, value: float) -> str:
        return repr(float(value))

    def describe(self) -> str:
        return "seconds"


@dataclass(frozen=True)
class Maybe(Kind[Any]):
    """``inner`` or unset. Unset has no TOML form: leave the key out."""

    inner: Kind[Any] = Text()

    def from_text(self, text: str) -> Any:
        return self.inner.from_text(text)

    def from_toml(self, value: Any) -> Any:
        return self.inner.from_toml(value)

    def to_toml(self, value: Any) -> str:
        return self.inner.to_toml(value)

    def describe(self) -> str:
        return self.inner.describe()


@dataclass(frozen=True)
class Items(Kind[Any]):
    """A list: a repeatable flag, a TOML array, or text with items split by commas (or a
    JSON array, for items that hold commas themselves)."""

    inner: Kind[Any] = Text()

    def from_text(self, text: str) -> Any:
        stripped = text.strip()
        if stripped.startswith("["):
            try:
                items = json.loads(stripped)
            except (ValueError, RecursionError):  # nested too deep is not a list of strings
                raise KindError(f"expected a JSON array of strings, got {_show(text)}") from None
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise KindError(f"expected a JSON array of strings, got {_show(text)}")
        else:
            items = [part.strip() for part in stripped.split(",") if part.strip()]
        return tuple(self.inner.from_text(i) for i in items)

    def from_items(self, items: Sequence[str]) -> Any:
        """Each item as given to a repeated flag."""
        return tuple(self.inner.from_text(i) for i in items)

    def from_toml(self, value: Any) -> Any:
        if not isinstance(value, list):
            raise KindError(f"expected an array of {self.inner.describe()}, got {_show(value)}")
        return tuple(self.inner.from_toml(v) for v in value)

    def to_toml(self, value: Any) -> str:
        return "[" + ", ".join(self.inner.to_toml(v) for v in value) + "]"

    def describe(self) -> str:
        return f"list of {self.inner.describe()}"


@dataclass(frozen=True)
class Parsed(Kind[Any]):
    """Text in a small syntax of its own (``NAME=DIR``), read by ``parse`` into a value
    whose ``str()`` is that text again. TOML gives the same text as a string."""

    parse: Callable[[str], Any] = str
    syntax: str = "a string"

    def from_text(self, text: str) -> Any:
        try:
            return self.parse(text)
        except ValueError as exc:
            raise KindError(str(exc)) from None

    def from_toml(self, value: Any) -> Any:
        if not isinstance(value, str):
            raise KindError(f"expected {self.syntax}, got {_show(value)}")
        return self.from_text(value)

    def to_toml(self, value: Any) -> str:
        return json.dumps(str(value))

    def describe(self) -> str:
        return self.syntax
