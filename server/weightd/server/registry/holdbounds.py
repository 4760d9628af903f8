"""What version holds may keep: the ``[versions]`` settings' values.

Apart from :mod:`.versions` so that the config, which every command loads, reads the
defaults without importing the registry (and, through it, numpy and safetensors).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HoldBounds:
    """What holds may keep (the ``[versions]`` settings; see the module docstring)."""

    max_old: int = 2
    max_holds: int = 4096
    max_holds_per_client: int = 256
    max_hold_seconds: float = 3600.0
