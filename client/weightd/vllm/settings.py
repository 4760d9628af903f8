"""The one reader of weightd's settings inside vLLM, with one rule per kind of value.

Three features take settings from vLLM: the loader (``--model-loader-extra-config``),
LoRA (``WEIGHTD_LORA``) and the weight-transfer backend (an update's ``update_info``,
the engine's ``init_info``). Each used to check its own: the loader refused a ``NaN``
timeout that ``WEIGHTD_LORA`` accepted, and an update's timeout was not checked at all.
Now each reads its keys through :class:`Settings`, so a kind of value (a number of
seconds, a daemon address, a choice) means the same wherever it is given, and a
mistake is refused in one line naming the setting and the key. An unknown key is
refused too: a typo must not silently turn a setting off.

Each feature names the error its plug point raises (see ``errors.py``): the loader's
stays a ``WeightdLoadError``, the others a :class:`~weightd.vllm.errors.SettingsError`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeVar, overload

from weightd.common.addresses import AddressError, parse_address
from weightd.common.sockets import default_target

from .errors import SettingsError

#: Longest time in seconds a timeout may be: a day. Past it a "timeout" is no bound at
#: all (and gRPC turns huge deadlines into overflow errors).
MAX_TIMEOUT_SECONDS: Final = 86400.0

S = TypeVar("S", bound=str)


@dataclass(frozen=True)
class Settings:
    """One source of settings (``where``: how messages name it), read key by key.

    Absent keys and ``None`` values take the default; anything else must be right.
    """

    where: str
    raw: Mapping[str, Any]
    error: type[Exception] = SettingsError

    @classmethod
    def of(
        cls,
        where: str,
        raw: Mapping[str, Any] | None,
        known: Iterable[str],
        error: type[Exception] = SettingsError,
    ) -> Settings:
        """``raw`` checked for keys outside ``known``."""
        raw = dict(raw or {})
        known = tuple(known)
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise error(f"{where} has unknown key(s) {unknown}; known keys: {list(known)}")
        return cls(where, raw, error)

    def _refuse(self, key: str, what: str, value: Any) -> Exception:
        return self.error(f"{self.where}[{key!r}] must be {what}, got {value!r}")

    def text(self, key: str) -> str | None:
        """A non-empty string, or None when absent."""
        value = self.raw.get(key)
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            raise self._refuse(key, "a non-empty string", value)
        return value

    def target(self, key: str = "target") -> str:
        """The daemon's address by the one address rule (``WeightClient`` applies the
        same); absent: the daemon's default socket."""
        target = self.text(key) or default_target()
        try:
            parse_address(target)
        except AddressError as exc:
            raise self.error(f"{self.where}[{key!r}]: {exc}") from None
        return target

    def choice(self, key: str, allowed: tuple[S, ...], default: S) -> S:
        """One of ``allowed``."""
        value = self.text(key) or default
        for option in allowed:
            if value == option:
                return option
        raise self.error(f"{self.where}[{key!r}] is {value!r}; expected one of {list(allowed)}")

    def flag(self, key: str, default: bool) -> bool:
        """``true`` or ``false`` (a number is not a flag)."""
        value = self.raw.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._refuse(key, "true or false", value)
        return value

    @overload
    def seconds(
        self, key: str, default: float, *, zero: bool = ..., most: float | None = ...
    ) -> float: ...
    @overload
    def seconds(
        self, key: str, default: None = None, *, zero: bool = ..., most: float | None = ...
    ) -> float | None: ...
    def seconds(
        self,
        key: str,
        default: float | None = None,
        *,
        zero: bool = False,
        most: float | None = MAX_TIMEOUT_SECONDS,
    ) -> float | None:
        """A finite number of seconds, positive (or zero when ``zero``), at most ``most``
        (None: no bound but finiteness).

        ``NaN`` and ``Infinity`` (which Python's JSON reads) are refused: with either a
        timeout fails every call at once with DEADLINE_EXCEEDED (NaN compares false
        with everything, so a ``<= 0`` check passes it)."""
        value = self.raw.get(key)
        if value is None:
            return default
        ok = _number(value) and math.isfinite(value) and (value >= 0 if zero else value > 0)
        if not ok or (most is not None and value > most):
            bound = "" if most is None else f" (at most {most:g})"
            sign = "non-negative" if zero else "positive"
            raise self._refuse(key, f"a {sign}, finite number of seconds{bound}", value)
        return float(value)

    def count(self, key: str, default: int) -> int:
        """A positive whole number (of bytes, of entries)."""
        value = self.raw.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self._refuse(key, "a positive whole number", value)
        return value

    def version(self, key: str = "version") -> int:
        """A version the daemon serves: a whole number from 1 (0, the moving "current"
        version, is not one an engine can be moved to and stay consistent)."""
        value = self.raw.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._refuse(key, "an integer", value)
        if value < 1:
            raise self.error(
                f"{self.where}[{key!r}] must name a version the daemon serves (>= 1: "
                "WatchVersions, `weightd list`), not the moving 'current' one"
            )
        return value


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))
