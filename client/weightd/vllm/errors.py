"""The loader's one error type: what vLLM shows a user whose weights did not load.

A ``RuntimeError`` because that is what vLLM's own loaders raise for an unusable
source, so its engine start-up reports it as it reports theirs. The message always
names the daemon (target), the model and the worker's layout, so the one line a user
sees says which of them to fix.
"""

from __future__ import annotations


class WeightdLoadError(RuntimeError):
    """Loading vLLM's weights from weightd failed; the message says where and why."""
