"""The daemon's resume decision (``weightd.server.rpc.resume.resume_start``): pure, table-tested."""

from __future__ import annotations

import grpc
import pytest

from weightd.server.base.errors import InvalidRequest, ModelChanged
from weightd.server.rpc.resume import resume_start
from weightd.server.rpc.status import grpc_status


def test_resume_start_within_the_rank_and_same_content() -> None:
    assert resume_start("m", 0, "", "fp", 10) == 0
    assert resume_start("m", 7, "fp", "fp", 10) == 7
    assert resume_start("m", 10, "fp", "fp", 10) == 10  # everything held: only FetchDone


def test_resume_against_other_content_is_aborted_with_the_reason() -> None:
    with pytest.raises(ModelChanged) as info:
        resume_start("llama", 5, "a" * 64, "b" * 64, 10)
    code, detail = grpc_status(info.value)
    assert code is grpc.StatusCode.ABORTED
    assert "model 'llama' changed" in detail and "from tensor 0" in detail


def test_resume_past_the_rank_is_invalid_argument_naming_the_field() -> None:
    with pytest.raises(InvalidRequest) as info:
        resume_start("llama", 11, "", "fp", 10)
    assert grpc_status(info.value)[0] is grpc.StatusCode.INVALID_ARGUMENT
    assert "start_index 11 is past the rank's 10 tensors" in str(info.value)
