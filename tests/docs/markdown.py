"""Just enough Markdown reading for the docs tests: links, and heading ids as
Python-Markdown's ``toc`` extension makes them (the ids MkDocs' anchors use)."""

from __future__ import annotations

import re
import unicodedata

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*(\{#([^}]+)\})?\s*$", re.MULTILINE)


def without_code(text: str) -> str:
    return _FENCE.sub("", text)


def links(text: str) -> list[str]:
    """Targets of every link and image outside fenced code."""
    body = without_code(text)
    return [m.group(1) for m in _LINK.finditer(body)] + [m.group(1) for m in _IMAGE.finditer(body)]


def slug(title: str) -> str:
    """Python-Markdown's default ``toc`` slugify (unicode folded, markup dropped)."""
    text = re.sub(r"<[^>]+>", "", title).replace("`", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def heading_ids(text: str) -> set[str]:
    ids: set[str] = set()
    for m in _HEADING.finditer(without_code(text)):
        base = m.group(3) or slug(m.group(1))
        candidate, n = base, 1
        while candidate in ids:  # toc numbers repeats: id, id_1, id_2 ...
            candidate = f"{base}_{n}"
            n += 1
        ids.add(candidate)
    return ids
