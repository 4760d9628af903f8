"""Which adapters a worker may have the daemon load by naming them, and what vouches for them.

``LoadAdapter`` is an admin RPC: the operator names a directory and, optionally, the
digest it must have. An inference engine, though, holds only the worker socket, and
what it has is a name a user put in a request (vLLM's ``model`` field). Letting it
trigger a load widens who decides what the daemon reads, so a load on request
(``ResolveAdapter`` with ``load``) is refused unless the operator said, per name,
that it may happen, and under the same trust rules as ``LoadAdapter``:

* **which names**: ``--adapter-autoload PATTERN`` (repeatable): an exact name, a
  ``PREFIX*``, or ``*``. Anything else is NOT_FOUND, as if it did not exist;
* **what vouches for the bytes**: a digest pinned by the operator
  (``--adapter-digest NAME=sha256:<hex>``, what an operator would give
  ``LoadAdapter``'s ``expected_digest``), or the operator's explicit statement that the
  adapter roots are the trust root (``--adapter-autoload-trust-roots``: whoever can
  write them decides what is served). Without either the load is refused before the
  roots are touched. ``s3://`` roots keep their own rule on top (a digest, or
  ``--trust-object-store``);
* **where**: the name is one path component, looked up directly under each root
  (local roots first, then ``s3://`` ones), so a request can never point elsewhere.

Pure: no I/O; the daemon's adapter service applies it (``service.py``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from ..base.errors import AdapterNotFound, AdapterTrustError, InvalidRequest, echo

_DIGEST: Final = re.compile(r"^sha256:[0-9a-f]{64}$")


def check_pattern(pattern: str) -> str:
    """``pattern`` if it is an exact name, ``PREFIX*`` or ``*``; else ValueError."""
    body = pattern[:-1] if pattern.endswith("*") else pattern
    if not pattern or "*" in body:
        raise ValueError(f"{pattern!r}: a name, NAME-PREFIX* or * (one '*', at the end)")
    if body:
        check_component(body, error=ValueError)
    return pattern


def check_digest(text: str) -> str:
    """``text`` if it is ``sha256:`` and 64 lowercase hex digits; else ValueError."""
    if not _DIGEST.match(text):
        raise ValueError(f"{text[:80]!r} is not an adapter digest (sha256:<64 hex digits>)")
    return text


def check_component(name: str, *, error: type[Exception] = InvalidRequest) -> None:
    """Refuse a name that could not be one directory name directly under a root."""
    if (
        "/" in name
        or "\\" in name
        or "\x00" in name
        or name in (".", "..")
        or name.startswith(".")
        or not name.isprintable()
    ):
        raise error(
            f"adapter name {echo(name)} cannot be loaded on request: it must be one plain "
            "directory name under an adapter root (no '/', '\\\\', leading '.')"
        )


@dataclass(frozen=True)
class AutoloadPolicy:
    """The operator's settings for loads on request (see the module docstring)."""

    allow: tuple[str, ...] = ()
    digests: Mapping[str, str] = field(default_factory=dict)
    trust_roots: bool = False
    #: Names with an OMS signature (``--adapter-signature``): it vouches for the bytes.
    signed: frozenset[str] = frozenset()

    @property
    def enabled(self) -> bool:
        return bool(self.allow)

    def allows(self, name: str) -> bool:
        """Whether ``name`` matches one of the operator's patterns (linear, no regex)."""
        for pattern in self.allow:
            if pattern.endswith("*"):
                if name.startswith(pattern[:-1]):
                    return True
            elif name == pattern:
                return True
        return False

    def check_allowed(self, name: str) -> None:
        """Raise unless a load on request of ``name`` is allowed (before any root is read)."""
        check_component(name)
        if not self.allows(name):
            raise AdapterNotFound(
                f"adapter {echo(name)} is not loaded, and the daemon loads adapters on a "
                "worker's request only for the names its operator allowed (--adapter-autoload)"
            )

    def expected_digest(self, name: str) -> str | None:
        """The digest ``name`` must have (None: the roots are trusted); raise when a
        load on request of ``name`` is not allowed or nothing vouches for it."""
        self.check_allowed(name)
        digest = self.digests.get(name)
        if digest is None and not self.trust_roots and name not in self.signed:
            raise AdapterTrustError(
                f"adapter {echo(name)} may be loaded on request, but nothing vouches for its "
                "bytes: the operator must pin its digest (--adapter-digest NAME=sha256:...) "
                "or trust the adapter roots (--adapter-autoload-trust-roots)"
            )
        return digest
