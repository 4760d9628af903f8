"""The path ``weightd.vllm.lora_middleware`` of weightd 0.1, kept so a ``vllm serve
--middleware weightd.vllm.lora_middleware.WeightdLoRAMiddleware`` command line written
for it still starts.

The middleware lives in :mod:`weightd.vllm.lora.middleware` (the LoRA feature's own
folder); this alias re-exports it and adds nothing.
"""

from __future__ import annotations

from .lora.middleware import WeightdLoRAMiddleware

__all__ = ["WeightdLoRAMiddleware"]
