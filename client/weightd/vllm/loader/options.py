"""``--model-loader-extra-config`` for ``--load-format weightd``, checked strictly.

Keys (all optional): ``target`` (gRPC target of the daemon; default: its default Unix
socket), ``model`` (the served model's name; default: the daemon's only model),
``fallback`` (``"none"``, or ``"disk"``: if weightd cannot serve this worker, load
from the model directory with vLLM's default loader and say so in the log),
``transport`` (``"auto"``: shared memory on the daemon's host, else gRPC; or
``"grpc"`` / ``"shm"`` to insist), ``timeout`` (seconds per call), ``identity``
(``"strict"``: refuse to load when a shard in the model directory cannot be proven to
be the daemon's, see ``identity.py``; ``"warn"``: the operator's opt-out, load and name
every unproven shard in a WARNING). An unknown key or a value of the wrong type is
refused: a typo must not silently turn a setting off.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import WeightdLoadError
from ..settings import Settings

Fallback = Literal["none", "disk"]
LoaderTransport = Literal["auto", "grpc", "shm"]
IdentityCheck = Literal["strict", "warn"]

_KEYS = ("target", "model", "fallback", "transport", "timeout", "identity")
_FALLBACKS: tuple[Fallback, ...] = ("none", "disk")
_TRANSPORTS: tuple[LoaderTransport, ...] = ("auto", "grpc", "shm")
_IDENTITY: tuple[IdentityCheck, ...] = ("strict", "warn")


@dataclass(frozen=True)
class LoaderOptions:
    """The loader's options, read from ``model_loader_extra_config`` (the keys above)."""

    target: str
    model: str | None = None
    fallback: Fallback = "none"
    transport: LoaderTransport = "auto"
    timeout: float | None = None
    identity: IdentityCheck = "strict"

    @property
    def model_label(self) -> str:
        """The model as messages name it: its name, or what the default means."""
        return repr(self.model) if self.model else "(the daemon's only model)"


def parse_options(extra: Mapping[str, Any] | None) -> LoaderOptions:
    """The loader's options from vLLM's ``model_loader_extra_config`` (a dict or None).

    Read with weightd's one settings reader (``settings.py``); a mistake is a
    :class:`WeightdLoadError`, as every failure of the loader is.
    """
    s = Settings.of("model_loader_extra_config", extra, _KEYS, WeightdLoadError)
    timeout = s.seconds("timeout")
    return LoaderOptions(
        target=s.target(),
        model=s.text("model"),
        fallback=s.choice("fallback", _FALLBACKS, "none"),
        transport=s.choice("transport", _TRANSPORTS, "auto"),
        timeout=timeout,
        identity=s.choice("identity", _IDENTITY, "strict"),
    )
