"""vLLM integration, one package per plug point: ``--load-format weightd`` loads a vLLM
engine's weights from weightd (``loader/``); ``WEIGHTD_LORA`` serves weightd's LoRA
adapters (``lora/``); ``weight_transfer_config={"backend": "weightd"}`` moves a running
engine to a new version in place (``transfer/``). All three fetch a worker's share
through ``share/``, read their settings through ``settings.py`` and raise the errors
of ``errors.py``.

Installed with ``pip install "weightd[vllm]"``; vLLM finds it through the
``vllm.general_plugins`` entry point and calls :func:`register` in every process it
starts (the engine and each worker), so nothing has to be imported or configured by
hand. Importing this package imports nothing of vLLM: only :func:`register` does, so
the rest of weightd (and its tests) works without vLLM installed.
"""

from __future__ import annotations


def register() -> None:
    """vLLM's plugin hook: make ``load_format="weightd"`` and the ``weightd`` weight-transfer
    backend known, and the ``weightd`` LoRA resolver when ``WEIGHTD_LORA`` is set (see
    :mod:`.lora.options`). Safe to call repeatedly."""
    from .loader.model_loader import register_loader
    from .transfer.backend import register_transfer

    register_loader()
    register_transfer()  # weight_transfer_config={"backend": "weightd"}
    _register_lora()


def _register_lora() -> None:
    import os

    from .lora.options import ENV, parse_lora_options

    if ENV in os.environ:
        # Read now: a mistake in it stops vLLM's start with one line, not each request.
        options = parse_lora_options(os.environ[ENV])
        from .lora.resolver import register_resolver
        from .lora.worker import install

        register_resolver()
        install(options)  # workers: a version named by a shared path comes from the daemon's pack
