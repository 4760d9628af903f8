"""``weightd serve``'s flags, derived from :class:`~weightd.server.config.ServeConfig`.

No flag is declared here: each comes from a setting (its name, help, default and
metavar), grouped by the config's sections. Flags default to "not given"
(``argparse.SUPPRESS``), so the loader can tell a flag from a default and let the
file and the environment fill what the command line left out.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from ..config import ServeConfig
from ..config.fields import Setting, sections, title
from ..config.kinds import ByteSize, Choice, Flag, Integer, Items, Kind, Maybe, Seconds
from ..config.load import CONFIG_ENV, SETTINGS


def default_text(s: Setting) -> str:
    """The default as ``--help`` and the reference show it."""
    kind = s.spec.kind
    if s.default is None:
        return "unset"
    if isinstance(kind, Items):
        return "none" if not s.default else kind.to_toml(s.default)
    if isinstance(kind, Flag):
        return "on" if s.default else "off"
    if isinstance(kind, Maybe):
        return kind.inner.to_toml(s.default)
    if s.default == "":
        return "empty"
    return str(s.default)


def _metavar(kind: Kind[Any]) -> str:
    while isinstance(kind, (Maybe, Items)):
        kind = kind.inner
    if isinstance(kind, Choice):
        return "{" + ",".join(kind.choices) + "}"
    if isinstance(kind, ByteSize):
        return "BYTES"
    if isinstance(kind, Integer):
        return "N"
    if isinstance(kind, Seconds):
        return "SECONDS"
    return "TEXT"


def _help(s: Setting) -> str:
    return f"{s.spec.help} [default: {default_text(s)}; {s.env}]".replace("%", "%%")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Every setting of ``ServeConfig`` as a flag, and ``--config FILE``."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help=f"TOML file of settings (keys as 'weightd config show' prints them); flags and "
        f"WEIGHTD_* variables override it [default: ${CONFIG_ENV}]",
    )
    groups: dict[str | None, Any] = {None: parser}
    for name, section in sections(ServeConfig):
        groups[name] = parser.add_argument_group(f"{title(section)} [{section.table}]")
    for s in SETTINGS:
        group = groups[s.section]
        kwargs: dict[str, Any] = {
            "dest": s.dest,
            "default": argparse.SUPPRESS,
            "help": _help(s),
        }
        if isinstance(s.spec.kind, Flag):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            if isinstance(s.spec.kind, Items):
                kwargs["action"] = "append"
            kwargs["metavar"] = s.spec.metavar or _metavar(s.spec.kind)
        group.add_argument(s.flag, **kwargs)


def given_flags(args: argparse.Namespace) -> Mapping[str, Any]:
    """What the command line gave, by setting ``dest`` (nothing it left out)."""
    return {s.dest: getattr(args, s.dest) for s in SETTINGS if hasattr(args, s.dest)}
