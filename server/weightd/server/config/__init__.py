"""The one typed configuration of ``weightd serve`` (see :mod:`.schema`).

Flags, the ``--config`` TOML file and ``WEIGHTD_*`` variables all fill the same
:class:`ServeConfig`; the stages get their own small option objects from
:mod:`.build`. This stage sits just below the daemon: it knows every stage's
defaults, and no stage below it knows the config.
"""

from .load import Loaded, Origin, load
from .schema import Named, ServeConfig

__all__ = ["Loaded", "Named", "Origin", "ServeConfig", "load"]
