"""Loaded models, their versions and publishing, as the edges name them."""

from ..registry.loading import Reloader
from ..registry.models import LoadedModel, ModelRegistry
from ..registry.publish import Prepared, PrepareVersion, Published, Publisher, no_preparation
from ..registry.versions import HeldVersion, ModelVersions, VersionEvent, VersionInfo

__all__ = [
    "HeldVersion",
    "LoadedModel",
    "ModelRegistry",
    "ModelVersions",
    "PrepareVersion",
    "Prepared",
    "Published",
    "Publisher",
    "Reloader",
    "VersionEvent",
    "VersionInfo",
    "no_preparation",
]
