"""The weights door: what every edge (gRPC, the same-host side socket) asks of the domain.

:class:`~.service.WeightService` is the one object a gRPC ``Fetch`` and a same-host
fetch both call: the model at a version (one rule for both wires), its plan for a
layout, the rank's view that reads and checks its slices, and marking a version broken
when its bytes turn out changed. The edges keep only their wire encoding, as
``rpc/adapters.py`` does over :class:`~weightd.server.adapters.service.AdapterService`.

The vocabulary the edges speak in is re-exported by :mod:`.layouts` (layouts and plans:
light, the CLI's configuration reads them without numpy) and :mod:`.models` (loaded
models, versions, publishing), so that neither edge imports ``plan/``, ``registry/``,
``store/`` or ``trust/`` itself (an import contract in ``pyproject.toml`` keeps it so);
what those stages do stays behind this door. This module imports nothing: a light
import of :mod:`.layouts` does not load the rest.
"""
