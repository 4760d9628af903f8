"""Every error weightd's vLLM integration raises on purpose, under one base.

Each feature raises the type vLLM expects of that plug point, so vLLM reports it as
it reports its own: the loader a ``RuntimeError`` (vLLM's loaders raise one for an
unusable source, and its engine start-up reports it so), the weight-transfer backend
a ``RuntimeError`` from the rank that raises it, a setting vLLM passes through (an
update's info, ``WEIGHTD_LORA``) a ``ValueError``, and an adapter a request names but
weightd cannot serve an :class:`AdapterUnavailable` carrying its HTTP status (see
``lora/refusals.py``; the resolver hands it to vLLM as vLLM's own
``GracefulHTTPError``). Every message names what to fix: the target, the model, the
worker's layout, the setting's key, or the adapter.
"""

from __future__ import annotations

from http import HTTPStatus


class WeightdVLLMError(Exception):
    """The base of every error weightd's vLLM integration raises on purpose."""


class SettingsError(WeightdVLLMError, ValueError):
    """A weightd setting given to vLLM cannot be read (``WEIGHTD_LORA``, an update's
    ``update_info`` or ``init_info``); the message names the setting and the key."""


class WeightdLoadError(WeightdVLLMError, RuntimeError):
    """Loading vLLM's weights from weightd failed; the message says where and why.

    The message always names the daemon (target), the model and the worker's layout,
    so the one line a user sees says which of them to fix.
    """


class WeightdUpdateError(WeightdVLLMError, RuntimeError):
    """An in-place update failed on some rank; no rank applied it (unless the message
    says so). :func:`weightd.vllm.transfer.rl.update_llm` raises it with the ranks' one
    message; a worker raises it inside vLLM, which reports it as its own error."""

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


class AdapterUnavailable(WeightdVLLMError):
    """An adapter a request named cannot be served; ``status`` is the HTTP answer.

    404: unknown (not loaded, not loadable on request); 400: refused (tampered, digest
    mismatch, another base model, modules PEFT would not apply, not allowed, vLLM
    refused it); 503: the daemon is unreachable, still loading it, or over its adapter
    budget; 500: the private copy could not be written. The message names the adapter
    and the reason.
    """

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
