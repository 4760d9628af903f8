"""Registering the ``weightd`` weight-transfer backend with vLLM (see ``transfer.py``).

Apart from ``transfer.py`` so that registering imports nothing of vLLM's weight
transfer: vLLM's factory imports the engine's module the first time an engine is
configured with ``weight_transfer_config={"backend": "weightd"}``.
"""

from __future__ import annotations

import logging

from ..errors import WeightdUpdateError

_registered = False

#: vLLM 0.32's loggers that log a worker's failed RPC with its traceback: the worker's
#: loop (``WorkerProc hit an exception.``, the traceback also attached as a note, so it
#: printed twice) and the engine core (``Invocation of collective_rpc method failed``).
WORKER_LOGGER = "vllm.v1.executor.multiproc_executor"
ENGINE_LOGGER = "vllm.v1.engine.core"


class OneLineUpdateErrors(logging.Filter):
    """A refused update is one line per rank, not tracebacks.

    Every rank logs the agreed message itself (``engine.py``), naming the rank(s),
    the daemon, the model, the version and why; a traceback of vLLM's RPC plumbing adds
    nothing. So the worker loop's record of a :class:`WeightdUpdateError` is dropped
    (``drop``) and the engine core's becomes one line. Other records pass unchanged.
    """

    def __init__(self, drop: bool) -> None:
        super().__init__()
        self.drop = drop

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        ours = WeightdUpdateError.from_vllm(exc) if exc is not None else None
        if ours is None:
            return True
        if self.drop:
            return False
        said = record.getMessage()
        record.msg = "%s: %s"
        record.args = (said, ours)
        record.exc_info = None
        record.exc_text = None
        return True


def register_transfer() -> None:
    """Register the backend once per process (vLLM may call its plugins more than once)."""
    global _registered  # noqa: PLW0603 -- registration is per process by vLLM's design
    if _registered:
        return
    _registered = True
    logging.getLogger(WORKER_LOGGER).addFilter(OneLineUpdateErrors(drop=True))
    logging.getLogger(ENGINE_LOGGER).addFilter(OneLineUpdateErrors(drop=False))
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if "weightd" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            "weightd", "weightd.vllm.transfer.engine", "WeightdWeightTransferEngine"
        )
