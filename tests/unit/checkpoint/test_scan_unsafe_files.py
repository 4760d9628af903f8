"""Checkpoint files that are not what they seem: refused by the loader, never waited on.

A single file or a config symlinked out of the model directory, and FIFOs in place
of a shard, ``config.json`` or the index (a read would block forever: each load runs
under a hang guard). The index's own rules are in ``test_scan_index.py``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.unit.tiny_checkpoint import (
    CONFIG,
    SHARD2,
    llama_tensors,
    split_in_two,
    write_json,
    write_model,
)
from weightd.server.base.errors import CheckpointError, UnsafePathError
from weightd.server.checkpoint.description import INDEX_FILE
from weightd.server.checkpoint.scan import load_checkpoint
from weightd.server.store.shards import ShardStore


def run_bounded(fn: Callable[[], Any], fifos: list[Path], limit: float = 3.0) -> tuple[bool, Any]:
    """Run ``fn`` in a thread; report whether it was still blocked after ``limit`` seconds.

    A call that blocks on a FIFO never returns by itself, so this is a hang guard, not a
    speed check. A blocked reader is released by opening and closing the write end.
    """
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(limit)
    hung = thread.is_alive()
    if hung:
        for fifo in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(30)
    value = result.get("value")
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], ShardStore):
        value[1].close()
    return hung, result.get("error", value)


def test_single_file_symlink_outside_root_is_refused(tmp_path: Path) -> None:
    root = write_model(tmp_path / "m", {"model.safetensors": llama_tensors()}, index=False)
    os.replace(root / "model.safetensors", tmp_path / "secret.safetensors")
    os.symlink(tmp_path / "secret.safetensors", root / "model.safetensors")
    with pytest.raises(UnsafePathError, match="outside the model directory") as info:
        load_checkpoint(str(root))
    assert info.value.path == str(root / "model.safetensors")


def test_fifo_shard_is_refused_without_hanging(tmp_path: Path) -> None:
    shards = split_in_two(llama_tensors())
    root = write_model(tmp_path / "m", shards)
    (root / SHARD2).unlink()
    os.mkfifo(root / SHARD2)
    hung, outcome = run_bounded(lambda: load_checkpoint(str(root)), [root / SHARD2])
    assert not hung, "loading a checkpoint whose shard is a FIFO blocked"
    assert isinstance(outcome, UnsafePathError), outcome
    assert outcome.path == str(root / SHARD2)
    assert "not a regular file" in str(outcome)


@pytest.mark.parametrize("which", ["config.json", INDEX_FILE])
def test_fifo_config_or_index_is_refused_without_hanging(tmp_path: Path, which: str) -> None:
    root = write_model(tmp_path / "m", split_in_two(llama_tensors()))
    (root / which).unlink()
    os.mkfifo(root / which)
    hung, outcome = run_bounded(lambda: load_checkpoint(str(root)), [root / which])
    assert not hung, f"loading a checkpoint whose {which} is a FIFO blocked"
    assert isinstance(outcome, CheckpointError), outcome


def test_config_symlink_outside_root_is_refused(tmp_path: Path) -> None:
    root = write_model(tmp_path / "m", {"model.safetensors": llama_tensors()}, index=False)
    secret = tmp_path / "secret.json"
    write_json(secret, {**CONFIG, "api_token": "hunter2"})
    (root / "config.json").unlink()
    os.symlink(secret, root / "config.json")
    hung, outcome = run_bounded(lambda: load_checkpoint(str(root)), [])
    assert not hung
    assert isinstance(outcome, UnsafePathError), outcome
