"""reference/settings.md: every ``weightd serve`` setting, from ``ServeConfig``."""

from __future__ import annotations


def render() -> str:
    from weightd.server.cli.config_commands import reference_markdown

    return reference_markdown()
