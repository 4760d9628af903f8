"""The command line's argument parser: a mistake is one line and exit status 1.

argparse's own reaction to a mistake is the whole usage block and status 2, and it
reports an unknown option only after everything else: ``weightd fetch --ouy x``
complained about the missing ``--out``, and ``weightd serve --modle DIR`` printed the
top-level usage with ``unrecognized arguments`` and no hint. Here each parser first
looks for options it does not know (before any other check, so the typo is what is
reported) and names the closest one it does; every error is then one line naming the
command, and where its options are listed.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

#: Everything after it is a value, even when it starts with ``--``.
_END_OF_OPTIONS = "--"
#: The status of every usage mistake, as of every other error of the command line.
USAGE_STATUS = 1


class Parser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` whose errors are one line and status 1.

    Its subparsers are of this class too (argparse makes them with the parent's class).
    """

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        tokens = list(sys.argv[1:] if args is None else args)
        self._refuse_unknown_options(tokens)
        return super().parse_known_args(tokens, namespace)

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_STATUS, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")

    def _refuse_unknown_options(self, tokens: list[str]) -> None:
        """The first ``--option`` in ``tokens`` that this parser has not, as an error.

        Only this parser's own part is looked at: the tokens after a subcommand's name
        are its parser's to check, and everything after ``--`` is a value.
        """
        known = [s for action in self._actions for s in action.option_strings if s[:2] == "--"]
        commands = self._commands()
        for arg in tokens:
            if arg in commands or arg == _END_OF_OPTIONS:
                return
            if not arg.startswith("--"):
                continue
            name = arg.split("=", 1)[0]
            if name in known or any(s.startswith(name) for s in known):
                continue  # exact, or a prefix argparse resolves (or calls ambiguous)
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else ""
            shown = name if name.isprintable() and len(name) <= 80 else repr(name[:80])
            self.error(f"unknown option {shown}{hint}")

    def _commands(self) -> set[str]:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return set(action.choices)
        return set()
