"""The loader's one error type: what vLLM shows a user whose weights did not load.

A ``RuntimeError`` because that is what vLLM's own loaders raise for an unusable
source, so its engine start-up reports it as it reports theirs. The message always
names the daemon (target), the model and the worker's layout, so the one line a user
sees says which of them to fix.
"""

from __future__ import annotations


class WeightdLoadError(RuntimeError):
    """Loading vLLM's weights from weightd failed; the message says where and why."""


class WeightdUpdateError(RuntimeError):
    """An in-place update failed on some rank; no rank applied it (unless the message
    says so). :func:`weightd.vllm.transfer.rl.update_llm` raises it with the ranks' one message;
    a worker raises it inside vLLM, which reports it as its own error."""

    #: Where the message starts inside the error vLLM raises for a worker's failure.
    PREFIX = "weightd: update"

    @classmethod
    def from_vllm(cls, exc: BaseException) -> WeightdUpdateError | None:
        """The backend's error inside one vLLM raised for it (wrapped by its worker RPC and
        engine-core layers as ``Call to ... failed: Worker failed with error '...',
        please check ...``), or None when ``exc`` is not one of ours."""
        text = str(exc)
        start = text.find(cls.PREFIX)
        if start < 0:
            return None
        text = text[start:]
        end = text.rfind("', please check")
        return cls(text[:end] if end > 0 else text)
