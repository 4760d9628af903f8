"""Reloading a served model atomically: the new version is verified off to the side.

A reload builds a complete :class:`~weightd.server.models.LoadedModel` — every check,
every digest — while the old version keeps serving, and swaps the registry entry
only when that succeeded. On any failure the old version is untouched and the error
is returned to the caller (SIGHUP logs it; an admin RPC can answer with it).
In-flight fetches keep the version they started with: the registry closes a
replaced model's files only when the last reference to it is gone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .errors import ModelNotFound, WeightdError
from .models import LoadedModel, ModelRegistry, load_model
from .verify import VerifyOptions

log = logging.getLogger("weightd.reload")

Loader = Callable[..., LoadedModel]


@dataclass(frozen=True)
class ReloadResult:
    name: str
    ok: bool
    detail: str  # what was published, or why not
    seconds: float


class Reloader:
    """Knows where each served model comes from; reloads one at a time per model."""

    def __init__(
        self,
        registry: ModelRegistry,
        sources: Mapping[str, str],
        options: VerifyOptions | None = None,
        loader: Loader = load_model,
    ) -> None:
        self.registry = registry
        self.sources = dict(sources)  # model name -> directory
        self.options = options
        self._loader = loader
        self._locks = {name: threading.Lock() for name in self.sources}

    def reload(self, name: str) -> LoadedModel:
        """Verify ``name``'s directory again and publish it; raises (old one kept) on failure."""
        directory = self.sources.get(name)
        if directory is None:
            raise ModelNotFound(
                f"model {name!r} is not served here (serving: {', '.join(sorted(self.sources))})"
            )
        with self._locks[name]:
            model = self._loader(directory, name, options=self.options)
            self.registry.publish(model)
        return model

    def reload_all(self) -> list[ReloadResult]:
        """Reload every model, each independently; log and return how each went."""
        results = []
        for name in sorted(self.sources):
            started = time.monotonic()
            try:
                model = self.reload(name)
            except WeightdError as exc:
                log.error("reload of model %s failed; the old version keeps serving: %s", name, exc)
                results.append(ReloadResult(name, False, str(exc), time.monotonic() - started))
                continue
            except Exception as exc:  # a bug: still never take the old version down
                log.exception("reload of model %s failed; the old version keeps serving", name)
                results.append(
                    ReloadResult(
                        name, False, f"internal error ({exc!r})", time.monotonic() - started
                    )
                )
                continue
            detail = (
                f"{len(model.checkpoint.tensors)} tensors, {model.checkpoint.total_bytes} bytes"
            )
            log.info("reloaded model %s: %s", name, detail)
            results.append(ReloadResult(name, True, detail, time.monotonic() - started))
        return results
