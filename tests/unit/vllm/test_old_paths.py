"""The 0.1 import paths users wrote in scripts and command lines still reach the same code."""

from __future__ import annotations

import importlib


def test_the_rl_helpers_keep_their_old_path() -> None:
    old = importlib.import_module("weightd.vllm.rl")
    new = importlib.import_module("weightd.vllm.transfer.rl")
    assert old.update_llm is new.update_llm
    assert old.update_info is new.update_info


def test_the_lora_middleware_keeps_its_old_path() -> None:
    old = importlib.import_module("weightd.vllm.lora_middleware")
    new = importlib.import_module("weightd.vllm.lora.middleware")
    assert old.WeightdLoRAMiddleware is new.WeightdLoRAMiddleware
