"""``WEIGHTD_LORA``: the one setting of weightd's LoRA integration for vLLM.

Either a gRPC target (``unix:///run/weightd/weightd.sock``; empty or ``default``: the
daemon's default socket) or a JSON object with the keys (all optional):

* ``target``: the daemon's worker address;
* ``model``: the served base model adapters must apply to (default: the daemon's
  only model);
* ``load``: ask the daemon to load an adapter that is not loaded (default true; the
  daemon decides, by its ``--adapter-autoload`` list, whether it may);
* ``dir``: where the private copies of verified adapters are written (default: a
  fresh 0700 directory under ``$TMPDIR``, removed at exit);
* ``retain_seconds``: how long a version's copy stays, once vLLM gives new requests
  another one, for requests still using it (default 3600);
* ``timeout``: seconds per daemon call (default 60; a load from object storage
  counts in it);
* ``max_bytes``: the largest adapter (both files) accepted (default 4 GiB);
* ``handover``: how vLLM's workers get a verified version: ``"auto"`` (default: where
  the daemon's side socket is on this host, they map its sealed pack of the version,
  no file written: :mod:`.shared`; else the private copy in ``dir``) or ``"files"``
  (always the private copy).

An unknown key or a value of the wrong type is refused: a typo must not silently turn
a setting off. vLLM's own switches (``--enable-lora``, ``--max-lora-rank``, ...) stay
vLLM's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Final

from ..errors import SettingsError
from ..settings import Settings

ENV: Final = "WEIGHTD_LORA"
_KEYS: Final = (
    "target",
    "model",
    "load",
    "dir",
    "retain_seconds",
    "timeout",
    "max_bytes",
    "handover",
)
HANDOVERS: Final = ("auto", "files")
#: The largest adapter accepted unless told: the daemon's own weights and config limits.
MAX_BYTES: Final = (4 << 30) + (4 << 20)


@dataclass(frozen=True)
class LoRAOptions:
    """weightd LoRA's options, read from ``WEIGHTD_LORA`` (the keys above)."""

    target: str
    model: str = ""
    load: bool = True
    dir: str = ""
    retain_seconds: float = 3600.0
    timeout: float = 60.0
    max_bytes: int = MAX_BYTES
    handover: str = "auto"


def parse_lora_options(text: str | None) -> LoRAOptions:
    """The options from ``WEIGHTD_LORA``'s text (None or empty: every default).

    Read with weightd's one settings reader (``settings.py``), as the loader's and an
    update's are; a mistake is a :class:`~weightd.vllm.errors.SettingsError`.
    """
    text = (text or "").strip()
    if not text.startswith("{"):
        bare = {"target": None if text in ("", "default") else text}
        return LoRAOptions(target=Settings.of(ENV, bare, _KEYS).target())
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SettingsError(f"{ENV} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise SettingsError(f"{ENV} must be a target or a JSON object")
    s = Settings.of(ENV, raw, _KEYS)
    return LoRAOptions(
        target=s.target(),
        model=s.text("model") or "",
        load=s.flag("load", True),
        dir=s.text("dir") or "",
        retain_seconds=s.seconds("retain_seconds", 3600.0, zero=True, most=None),
        timeout=s.seconds("timeout", 60.0),
        max_bytes=s.count("max_bytes", MAX_BYTES),
        handover=s.choice("handover", HANDOVERS, "auto"),
    )
