"""The path ``weightd.vllm.rl`` of weightd 0.1, kept so a controller's imports still work.

The helpers live in :mod:`weightd.vllm.transfer.rl` (the weight-transfer feature's own
folder); this alias re-exports them and adds nothing.
"""

from __future__ import annotations

from .transfer.rl import update_info, update_llm

__all__ = ["update_info", "update_llm"]
