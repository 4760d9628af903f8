"""Declaring a setting once: its default, help, kind and check, and the names derived.

A setting is a dataclass field made by :func:`setting`. Everything else is derived
from where the field sits, so no name is written twice:

- the TOML key is the field's name, under ``[section]`` for a section's field;
- the flag is ``--`` + the section's flag prefix + the name with ``_`` as ``-``;
- the environment variable is ``WEIGHTD_`` + the flag's name in capitals, ``-`` as ``_``.

:func:`settings` walks a config class and yields one :class:`Setting` per field, in
declaration order: what the argument parser, the loader, ``weightd config show`` and
the generated reference page all read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from .kinds import Kind

#: Every environment variable of a setting starts with this.
ENV_PREFIX: Final = "WEIGHTD_"
_META: Final = "weightd_setting"

#: A check returns the problem (``"must be at least 1"``) or None when the value is fine.
Check = Callable[[Any], "str | None"]


@dataclass(frozen=True)
class Spec:
    """What :func:`setting` records on the field."""

    kind: Kind[Any]
    help: str
    metavar: str | None
    checks: tuple[Check, ...]


def setting(
    default: Any,
    kind: Kind[Any],
    help: str,
    *,
    metavar: str | None = None,
    check: Check | tuple[Check, ...] = (),
) -> Any:
    """A config field. ``help`` is the flag's help, the reference's text and the
    file's comment; ``check`` refuses values the kind admits but the daemon cannot use."""
    checks = check if isinstance(check, tuple) else (check,)
    meta = {_META: Spec(kind, help, metavar, checks)}
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple for a list setting's default")
    return dataclasses.field(default=default, metadata=meta)


class Section:
    """A group of settings: one ``[table]`` in the file, one group in ``--help``.

    The class docstring's first line is the group's title; ``flag_prefix`` is put
    before every field's flag (``s3-`` makes ``endpoint`` ``--s3-endpoint``).
    """

    table: ClassVar[str]
    flag_prefix: ClassVar[str] = ""


@dataclass(frozen=True)
class Setting:
    """One setting, with every name it goes by."""

    #: ``section.field``, or ``field`` at the top level: how code and messages refer to it.
    path: str
    section: str | None
    key: str
    flag: str
    env: str
    default: Any
    spec: Spec

    @property
    def dest(self) -> str:
        """The argparse destination (unique: the path with ``.`` as ``__``)."""
        return self.path.replace(".", "__")

    @property
    def toml_name(self) -> str:
        return f"[{self.section}] {self.key}" if self.section else self.key

    def check(self, value: Any) -> str | None:
        for check in self.spec.checks:
            problem = check(value)
            if problem is not None:
                return problem
        return None


def _flag(prefix: str, name: str) -> str:
    return "--" + prefix + name.replace("_", "-")


def _env(flag: str) -> str:
    return ENV_PREFIX + flag[2:].upper().replace("-", "_")


def settings(config_class: type) -> Iterator[Setting]:
    """Every setting of ``config_class``: its own fields, then each section's, in order."""
    for f in dataclasses.fields(config_class):
        spec = f.metadata.get(_META)
        if spec is not None:
            flag = _flag("", f.name)
            yield Setting(f.name, None, f.name, flag, _env(flag), f.default, spec)
            continue
        section = _section_class(f)
        if section is None:
            continue  # an internal field (tests' gRPC options): no flag, key or variable
        for sf in dataclasses.fields(section):
            sspec = sf.metadata.get(_META)
            if sspec is None:
                continue
            flag = _flag(section.flag_prefix, sf.name)
            path = f"{f.name}.{sf.name}"
            yield Setting(path, f.name, sf.name, flag, _env(flag), sf.default, sspec)


def sections(config_class: type) -> Iterator[tuple[str, Any]]:
    """``(field name, section class)`` of each section, in order."""
    for f in dataclasses.fields(config_class):
        section = _section_class(f)
        if section is not None:
            yield f.name, section


def _section_class(f: dataclasses.Field[Any]) -> Any:
    """The section class a field holds (its default factory), or None."""
    factory: Any = f.default_factory
    if isinstance(factory, type) and issubclass(factory, Section):
        return factory
    return None


def title(section: type) -> str:
    """The first line of the section's docstring."""
    return (section.__doc__ or section.__name__).strip().splitlines()[0].rstrip(".")


# --- checks shared by many settings ------------------------------------------------------


def at_least(low: float) -> Check:
    def check(value: Any) -> str | None:
        return None if value is None or value >= low else f"must be at least {low}"

    return check


def at_most(high: float) -> Check:
    def check(value: Any) -> str | None:
        return None if value is None or value <= high else f"must be at most {high}"

    return check


def positive(value: Any) -> str | None:
    return None if value is None or value > 0 else "must be more than 0"


def not_negative(value: Any) -> str | None:
    return None if value is None or value >= 0 else "must be 0 or more"


def non_empty(value: Any) -> str | None:
    return None if value is None or value != "" else "must not be empty"
