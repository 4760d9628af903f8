"""One settings rule for every feature of ``weightd.vllm`` (``settings.py``, issue 47).

The loader's ``model_loader_extra_config`` and LoRA's ``WEIGHTD_LORA`` read their keys
through the same reader, so a value refused by one is refused by the other, each with
its feature's error type and a message naming the setting and the key. (The
weight-transfer backend's ``update_info`` needs vLLM's classes: tests/vllm.)
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from weightd.common.sockets import default_target
from weightd.vllm.errors import SettingsError, WeightdLoadError, WeightdVLLMError
from weightd.vllm.loader.options import parse_options
from weightd.vllm.lora.options import parse_lora_options
from weightd.vllm.settings import MAX_TIMEOUT_SECONDS, Settings

#: Timeouts both features must refuse: JSON reads NaN and Infinity as floats.
BAD_TIMEOUTS: list[Any] = [math.nan, math.inf, -math.inf, 0, -1, True, "5", 1e300]


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS, ids=repr)
def test_a_timeout_one_feature_refuses_the_other_refuses_too(timeout: Any) -> None:
    with pytest.raises(WeightdLoadError, match=r"model_loader_extra_config\['timeout'\]"):
        parse_options({"timeout": timeout})
    text = json.dumps({"timeout": timeout})  # NaN and Infinity as Python's JSON writes them
    with pytest.raises(SettingsError, match=r"WEIGHTD_LORA\['timeout'\]"):
        parse_lora_options(text)


@pytest.mark.parametrize("target", ["localhost", "http://h:1", ""])
def test_a_target_follows_the_one_address_rule_in_both(target: str) -> None:
    with pytest.raises(WeightdLoadError, match="target"):
        parse_options({"target": target})
    with pytest.raises(SettingsError, match="target"):
        parse_lora_options(json.dumps({"target": target}))


def test_good_values_mean_the_same_in_both() -> None:
    loader = parse_options({"target": "unix:///x.sock", "timeout": 5})
    lora = parse_lora_options('{"target": "unix:///x.sock", "timeout": 5}')
    assert (loader.target, loader.timeout) == (lora.target, lora.timeout) == ("unix:///x.sock", 5)
    assert parse_lora_options("").target == parse_options(None).target == default_target()
    assert parse_lora_options('{"retain_seconds": 0}').retain_seconds == 0


def test_every_error_has_one_base() -> None:
    for cls in (SettingsError, WeightdLoadError):
        assert issubclass(cls, WeightdVLLMError)
    assert issubclass(SettingsError, ValueError) and issubclass(WeightdLoadError, RuntimeError)


def test_the_reader_names_the_setting_and_the_key() -> None:
    with pytest.raises(SettingsError, match=r"unknown key\(s\) \['tiemout'\]"):
        Settings.of("update_info", {"tiemout": 1}, ("timeout",))
    s = Settings("update_info", {"version": 0, "n": 3, "flag": 1, "t": "fast"})
    with pytest.raises(SettingsError, match=r"update_info\['version'\] must name a version"):
        s.version()
    with pytest.raises(SettingsError, match=r"update_info\['flag'\] must be true or false"):
        s.flag("flag", False)
    with pytest.raises(SettingsError, match=r"expected one of \['auto', 'grpc'\]"):
        s.choice("t", ("auto", "grpc"), "auto")
    assert s.count("n", 1) == 3 and s.seconds("absent", 2.5) == 2.5
    assert s.seconds("absent") is None
    day = Settings("x", {"t": MAX_TIMEOUT_SECONDS})
    assert day.seconds("t") == MAX_TIMEOUT_SECONDS
