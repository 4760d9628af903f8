"""Ctrl-C during start-up verification is a cancel, not a failure (issue #39, point 6).

The daemon raises ``ShutdownRequested`` in its main thread when the first signal comes
during start-up. Reaching the model loader, that used to log ``verify_failed ...
reason=internal`` and count a verification failure; it is a cancel: no event, no metric,
the exception passes on to ``serve``, which logs ``exit`` with the signal.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from weightd.server.cli.demo import ensure_demo_checkpoint
from weightd.server.daemon.lifecycle import ShutdownRequested
from weightd.server.registry.loading import load_observed
from weightd.server.telemetry.metrics import Metrics


def test_a_signal_during_verification_is_no_verify_failed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = ensure_demo_checkpoint(str(tmp_path / "cache"))
    metrics = Metrics.create(CollectorRegistry(), version="test")

    def on_alarm(signum: int, frame: object) -> None:
        raise ShutdownRequested(signal.SIGINT)

    old = signal.signal(signal.SIGALRM, on_alarm)
    caplog.set_level(logging.INFO)
    signal.setitimer(signal.ITIMER_REAL, 0.0005)
    try:
        with pytest.raises(ShutdownRequested) as info:
            load_observed(model, "demo", metrics)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    frames = []
    tb = info.tb
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert "load_observed" in frames  # the signal came while loading, as at start-up
    assert "verify_failed" not in caplog.text
    assert metrics.verify_failures.labels("demo", "internal")._value.get() == 0


def test_a_real_failure_still_says_verify_failed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with pytest.raises(Exception):  # noqa: B017 -- whichever error: it is reported
        load_observed(str(tmp_path / "missing"), "gone", None)
    assert "verify_failed" in caplog.text
