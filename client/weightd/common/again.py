"""The words a daemon's refusal carries when the same request will succeed if asked again
shortly (a load on request in progress, all load slots busy): the client retries those
and only those, so an unreachable daemon still fails at once."""

from __future__ import annotations

from typing import Final

ASK_AGAIN: Final = "ask again shortly"


def asks_again(detail: str) -> bool:
    return ASK_AGAIN in detail
