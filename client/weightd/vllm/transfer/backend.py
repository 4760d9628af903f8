"""Registering the ``weightd`` weight-transfer backend with vLLM (see ``transfer.py``).

Apart from ``transfer.py`` so that registering imports nothing of vLLM's weight
transfer: vLLM's factory imports the engine's module the first time an engine is
configured with ``weight_transfer_config={"backend": "weightd"}``.
"""

from __future__ import annotations

_registered = False


def register_transfer() -> None:
    """Register the backend once per process (vLLM may call its plugins more than once)."""
    global _registered  # noqa: PLW0603 -- registration is per process by vLLM's design
    if _registered:
        return
    _registered = True
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if "weightd" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            "weightd", "weightd.vllm.transfer.engine", "WeightdWeightTransferEngine"
        )
