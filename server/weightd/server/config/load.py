"""Filling a :class:`ServeConfig` from defaults, a TOML file, ``WEIGHTD_*`` and flags.

Precedence, lowest first: the declared default, the ``--config`` file (or the file
``WEIGHTD_CONFIG`` names), the environment, the command line. A later source
replaces a list as a whole (flags given twice append to each other, not to the
file's list). Every value remembers where it came from (:class:`Origin`), so an error
names the flag, the variable or the file's key the bad value was written in, and
``weightd config show`` can say why each setting has its value.

The file is read once, by descriptor, bounded (:data:`MAX_CONFIG_BYTES`), and refused
whole on an unknown key, a wrong type or a syntax error: one line naming the key.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from weightd.common.sockets import default_target

from ..base.errors import ConfigFileError, UsageError
from ..base.readfile import ReadRefused, read_bounded
from .build import default_cache_dir
from .fields import ENV_PREFIX, Setting, sections, settings
from .kinds import Flag, Items, KindError
from .schema import ServeConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

#: Largest config file read; a config is a page of text, not data.
MAX_CONFIG_BYTES: Final = 1 << 20
#: The variable naming the config file when ``--config`` is not given.
CONFIG_ENV: Final = ENV_PREFIX + "CONFIG"

SETTINGS: Final = tuple(settings(ServeConfig))
_BY_PATH: Final = {s.path: s for s in SETTINGS}


@dataclass(frozen=True)
class Origin:
    """Where a value came from: ``default``, ``file``, ``env`` or ``flag``, and its name."""

    source: Literal["default", "file", "env", "flag"]
    name: str = ""

    def __str__(self) -> str:
        return self.name if self.name else self.source


@dataclass
class Loaded:
    """The config and where each value came from (keyed by setting path)."""

    config: ServeConfig
    origins: dict[str, Origin] = field(default_factory=dict)
    file: str | None = None

    def where(self, path: str) -> str:
        """How the user wrote ``path``: the flag, variable or file key (else the flag)."""
        origin = self.origins.get(path)
        if origin is None or origin.source == "default":
            return _BY_PATH[path].flag
        return origin.name


def read_config_file(path: str) -> dict[str, Any]:
    """The TOML document at ``path``: a regular file, at most :data:`MAX_CONFIG_BYTES`."""
    try:
        data = read_bounded(path, MAX_CONFIG_BYTES)
    except ReadRefused as exc:
        raise ConfigFileError(f"{path}: config file: {exc.reason}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigFileError(f"{path}: not UTF-8 at byte {exc.start}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"{path}: not valid TOML: {exc}") from None
    except RecursionError:  # the parser recurses once per nested array or table
        raise ConfigFileError(
            f"{path}: not a config file: arrays or tables nested too deep"
        ) from None


def _unknown(path: str, key: str, known: Iterable[str], where: str) -> ConfigFileError:
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    homes = [s.toml_name for s in SETTINGS if s.key == key and f"[{s.section}] " != where]
    if homes:
        hint = f" here (did you mean {' or '.join(homes)}?)"
    return ConfigFileError(f"{path}: {where}{key}: unknown key{hint}")


def file_values(doc: Mapping[str, Any], path: str) -> dict[str, tuple[Any, Origin]]:
    """Each setting the document gives, converted, with its origin. Unknown keys,
    wrong types and values their checks refuse raise :class:`ConfigFileError`."""
    out: dict[str, tuple[Any, Origin]] = {}
    tables = dict(sections(ServeConfig))
    top = {s.key: s for s in SETTINGS if s.section is None}
    for key, value in doc.items():
        if key in tables:
            if not isinstance(value, dict):
                raise ConfigFileError(f"{path}: {key}: expected a [{key}] table")
            own = {s.key: s for s in SETTINGS if s.section == key}
            for skey, svalue in value.items():
                if skey not in own:
                    raise _unknown(path, skey, own, f"[{key}] ")
                out[own[skey].path] = _from_toml(own[skey], svalue, path)
        elif key in top:
            out[key] = _from_toml(top[key], value, path)
        else:
            raise _unknown(path, key, [*top, *tables], "")
    return out


def _from_toml(s: Setting, value: Any, path: str) -> tuple[Any, Origin]:
    origin = Origin("file", f"{path}: {s.toml_name}")
    try:
        converted = s.spec.kind.from_toml(value)
    except KindError as exc:
        raise ConfigFileError(f"{origin}: {exc}") from None
    _check(s, converted, origin, ConfigFileError)
    return converted, origin


def env_values(env: Mapping[str, str]) -> dict[str, tuple[Any, Origin]]:
    """Each setting a ``WEIGHTD_*`` variable gives (an empty variable counts as unset).

    Other ``WEIGHTD_*`` variables are not settings (the scripts' own, such as
    ``WEIGHTD_PYTHON``) and are left alone.
    """
    out: dict[str, tuple[Any, Origin]] = {}
    for s in SETTINGS:
        text = env.get(s.env)
        if not text:
            continue
        origin = Origin("env", s.env)
        try:
            value = s.spec.kind.from_text(text)
        except KindError as exc:
            raise UsageError(f"{s.env}={_quote(text)}: {exc}") from None
        _check(s, value, origin, UsageError)
        out[s.path] = (value, origin)
    return out


def flag_values(given: Mapping[str, Any]) -> dict[str, tuple[Any, Origin]]:
    """Each setting given on the command line. ``given`` maps a setting's ``dest`` to
    what argparse collected: a bool for a flag, a list of texts for a list, else text."""
    out: dict[str, tuple[Any, Origin]] = {}
    for s in SETTINGS:
        if s.dest not in given:
            continue
        raw = given[s.dest]
        negated = raw is False and isinstance(s.spec.kind, Flag)
        origin = Origin("flag", "--no-" + s.flag[2:] if negated else s.flag)
        try:
            if isinstance(raw, bool):
                value: Any = raw
            elif isinstance(s.spec.kind, Items):
                value = s.spec.kind.from_items(raw)
            else:
                value = s.spec.kind.from_text(raw)
        except KindError as exc:
            raise UsageError(f"{s.flag} {_quote(str(raw))}: {exc}") from None
        _check(s, value, origin, UsageError)
        out[s.path] = (value, origin)
    return out


def _check(s: Setting, value: Any, origin: Origin, error: type[UsageError]) -> None:
    problem = s.check(value)
    if problem is not None:
        shown = _quote(str(value if not isinstance(value, tuple) else ",".join(map(str, value))))
        given = {"env": f"{origin}={shown}", "file": f"{origin} = {shown}"}
        raise error(f"{given.get(origin.source, f'{origin} {shown}')}: {problem}")


def _quote(text: str) -> str:
    printable = text.isprintable() and len(text) <= 80
    return text if printable and text and " " not in text else repr(text[:80])


def load(
    flags: Mapping[str, Any],
    env: Mapping[str, str],
    config_file: str | None = None,
) -> Loaded:
    """The effective config. ``config_file``: ``--config``; else ``WEIGHTD_CONFIG``."""
    path = config_file or env.get(CONFIG_ENV) or None
    layers = [
        file_values(read_config_file(path), path) if path else {},
        env_values(env),
        flag_values(flags),
    ]
    config = ServeConfig()
    loaded = Loaded(config, {s.path: Origin("default") for s in SETTINGS}, path)
    for layer in layers:
        for key, (value, origin) in layer.items():
            config.set(key, value)
            loaded.origins[key] = origin
    # Derived defaults, made concrete so `config show` prints what the daemon will use.
    if not config.listen:
        config.listen = default_target()
    if not config.cache_dir:
        config.cache_dir = default_cache_dir(dict(env))
    return loaded


def check(loaded: Loaded, names: list[str]) -> None:
    """Raise the first rule involving several settings that ``loaded`` breaks."""
    for path, problem in loaded.config.problems(names):
        raise UsageError(f"{loaded.where(path)}: {problem}")
