"""reference/cli.md: every ``weightd`` command, from the argparse parser ``main`` runs."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from . import banner


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help_of(parser: argparse.ArgumentParser, name: str) -> str:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.dest == name:
                    return choice.help or ""
    return ""


def _walk(
    parser: argparse.ArgumentParser, path: tuple[str, ...]
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser, argparse.ArgumentParser]]:
    """(command path, its parser, its parent's parser), depth first, in declared order."""
    for name, sub in _subcommands(parser).items():
        yield (*path, name), sub, parser
        yield from _walk(sub, (*path, name))


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    if action.required or action.default in (None, argparse.SUPPRESS, [], ()):
        return ""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return ""
    return f"`{action.default}`"


def _arguments(parser: argparse.ArgumentParser, settings: set[str]) -> tuple[list[str], bool]:
    """The table rows of ``parser``'s own arguments, and whether it also takes every
    serve setting (those are listed once, on the settings page)."""
    rows: list[str] = []
    takes_settings = settings <= {a.dest for a in parser._actions}
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if takes_settings and action.dest in settings:
            continue
        if action.option_strings:
            names = ", ".join(f"`{o}`" for o in action.option_strings)
            if action.metavar is not None:
                names += f" `{action.metavar}`"
            elif action.nargs != 0:
                names += f" `{action.dest.upper()}`"
        else:
            names = f"`{action.metavar or action.dest}`"
        if isinstance(action.metavar, tuple):  # pragma: no cover - not used by weightd
            names = f"`{' '.join(action.metavar)}`"
        notes = []
        if action.required and action.option_strings:
            notes.append("required")
        if action.choices is not None and not isinstance(action.choices, dict):
            notes.append("one of " + ", ".join(f"`{c}`" for c in action.choices))
        if isinstance(action, argparse._AppendAction) and "repeatable" not in (action.help or ""):
            notes.append("repeatable")
        help_text = _cell((action.help or "").replace("%%", "%"))
        extra = f" ({'; '.join(notes)})" if notes else ""
        rows.append(f"| {names} | {help_text}{extra} | {_default(action)} |")
    return rows, takes_settings


def render() -> str:
    from weightd.server.cli.main import _parser
    from weightd.server.config.load import SETTINGS

    settings = {s.dest for s in SETTINGS}
    root = _parser()
    out = [
        "# Command line",
        "",
        banner("weightd.server.cli.main's argparse parser"),
        "",
        f"`weightd`: {root.description} Every command prints `--help`; a failure is one "
        "line on stderr and exit status 1, never a traceback. The commands that talk to a "
        "running daemon take its address (`TARGET`); `serve`'s options are on "
        "[Serve settings](settings.md).",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    commands = list(_walk(root, ()))
    for path, _, parent in commands:
        anchor = "-".join(path)
        out.append(
            f"| [`weightd {' '.join(path)}`](#{anchor}) | {_cell(_help_of(parent, path[-1]))} |"
        )
    for path, parser, parent in commands:
        anchor = "-".join(path)
        heading = "#" * (1 + len(path))
        out += ["", f"{heading} `weightd {' '.join(path)}` {{#{anchor}}}", ""]
        text = parser.description or _help_of(parent, path[-1])
        if text:
            out += [_cell(text.replace("%%", "%")), ""]
        # A fixed width: argparse would follow $COLUMNS, and the page must not.
        formatter = parser.formatter_class(prog=parser.prog, width=90)
        formatter.add_usage(
            parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix=""
        )
        usage = formatter.format_help().strip()
        out += ["```text", usage, "```"]
        rows, takes_settings = _arguments(parser, settings)
        if rows:
            out += ["", "| argument | meaning | default |", "|---|---|---|", *rows]
        if takes_settings:
            out += [
                "",
                "It also takes every serve setting as a flag: see [Serve settings](settings.md).",
            ]
    return "\n".join(out) + "\n"
