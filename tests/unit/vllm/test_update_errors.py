"""A refused in-place update reaches the caller as ``WeightdUpdateError``, logged in one line.

vLLM wraps a worker's error twice (its worker RPC, then its engine core) into a plain
``Exception``; ``update_llm`` hands the caller the backend's own error, and the log
filter installed with the backend turns vLLM's tracebacks of it into one line (the
engine test, ``tests/vllm/test_vllm_transfer.py``, checks both with the real engine).
"""

from __future__ import annotations

import logging
import sys

import pytest

from weightd.vllm.errors import WeightdUpdateError
from weightd.vllm.transfer.backend import OneLineUpdateErrors

MESSAGE = (
    "weightd: update refused on every rank: the ranks would take different content "
    "(refused before any rank fetched a byte; the engine keeps version 3): rank 0 ... "
    "takes model 'm' version 1 (content 0a1b2c3d4e5f); rank 1 ... takes model 'm' "
    "version 2 (content 6a7b8c9d0e1f)"
)
#: What vLLM 0.32's offline LLM raises for it (engine core around the executor's error).
WRAPPED = (
    f"Call to collective_rpc method failed: Worker failed with error '{MESSAGE}', "
    "please check the stack trace above for the root cause"
)


def test_the_backends_message_is_taken_out_of_vllms_wrapping() -> None:
    got = WeightdUpdateError.from_vllm(Exception(WRAPPED))
    assert isinstance(got, WeightdUpdateError)
    assert str(got) == MESSAGE
    assert str(WeightdUpdateError.from_vllm(WeightdUpdateError(MESSAGE))) == MESSAGE
    assert WeightdUpdateError.from_vllm(RuntimeError("CUDA out of memory")) is None


def _record(exc: BaseException) -> logging.LogRecord:
    try:
        raise exc
    except BaseException:
        info = sys.exc_info()
    return logging.LogRecord("vllm", logging.ERROR, __file__, 1, "%s failed", ("rpc",), info)


@pytest.mark.parametrize("drop", [True, False])
def test_vllms_traceback_of_a_refused_update_becomes_one_line(drop: bool) -> None:
    record = _record(Exception(WRAPPED))
    kept = OneLineUpdateErrors(drop).filter(record)
    if drop:  # the worker loop's record: the rank logged the message itself
        assert not kept
        return
    assert kept
    assert record.exc_info is None
    assert record.getMessage() == f"rpc failed: {MESSAGE}"
    assert "\n" not in logging.Formatter().format(record)


def test_other_errors_keep_their_traceback() -> None:
    record = _record(RuntimeError("CUDA out of memory"))
    assert OneLineUpdateErrors(drop=True).filter(record)
    assert record.exc_info is not None
    assert "Traceback" in logging.Formatter().format(record)
