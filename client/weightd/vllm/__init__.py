"""vLLM integration: ``--load-format weightd`` loads a vLLM engine's weights from weightd;
``weight_transfer_config={"backend": "weightd"}`` moves a running engine to a new
version in place (``transfer.py``, ``rl.py``).

Installed with ``pip install "weightd[vllm]"``; vLLM finds it through the
``vllm.general_plugins`` entry point and calls :func:`register` in every process it
starts (the engine and each worker), so nothing has to be imported or configured by
hand. Importing this package imports nothing of vLLM: only :func:`register` does, so
the rest of weightd (and its tests) works without vLLM installed.
"""

from __future__ import annotations


def register() -> None:
    """vLLM's plugin hook: make ``load_format="weightd"`` and the ``weightd`` weight-transfer
    backend known. Safe to call repeatedly."""
    from .backend import register_transfer
    from .loader import register_loader

    register_loader()
    register_transfer()  # weight_transfer_config={"backend": "weightd"}
