"""vLLM's ``LoRAResolver`` for weightd: an unknown model id is looked up as a weightd adapter.

Registered by :func:`weightd.vllm.register` (the ``vllm.general_plugins`` entry point,
run in every vLLM process) when ``WEIGHTD_LORA`` is set. vLLM's OpenAI server asks
resolvers about a model id it does not serve only with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (``entrypoints/serve/engine/serving.py``
``_check_model``), a switch vLLM marks as for development; it then loads what the
resolver returns with ``engine_client.add_lora`` (which reports a failure as an
error, not an engine crash) and keeps it under that name **for the server's life**:
vLLM asks a resolver about a name once, and gives it no way to replace or drop what
it returned. So with the resolver alone a new daemon version of an adapter is not
picked up, nor an unload; :mod:`.lora_middleware` does that, without the development
switch.

A refusal is raised as vLLM's ``GracefulHTTPError`` carrying the status (404 unknown,
400 refused, 503 daemon unreachable or over budget) and a message naming the adapter
and the daemon's reason; vLLM answers the request with it and keeps serving. An
unknown name is left to the other resolvers when vLLM has some (its filesystem or Hub
resolver): this one then answers None, and vLLM says the model does not exist.
"""

from __future__ import annotations

from http import HTTPStatus

from vllm.exceptions import GracefulHTTPError
from vllm.lora.request import LoRARequest
from vllm.lora.resolver import LoRAResolver, LoRAResolverRegistry

from ..errors import AdapterUnavailable, WeightdVLLMError
from .hub import hub

RESOLVER_NAME = "weightd"


class WeightdLoRAError(GracefulHTTPError, WeightdVLLMError):  # type: ignore[misc]  # vLLM: untyped here
    """An adapter weightd cannot serve (:class:`~weightd.vllm.errors.AdapterUnavailable`),
    as the HTTP error vLLM sends the client."""


class WeightdLoRAResolver(LoRAResolver):  # type: ignore[misc]
    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        try:
            prepared = await hub().current(lora_name, base_model_name)
        except AdapterUnavailable as exc:
            if left_to_others(exc):
                return None
            raise WeightdLoRAError(exc.message, exc.status) from None
        # vLLM sets lora_int_id itself (its own counter) before loading it.
        return LoRARequest(lora_name=prepared.lora_name, lora_int_id=1, lora_path=prepared.path)


def left_to_others(exc: AdapterUnavailable) -> bool:
    """Whether a request weightd refused goes on to vLLM's other resolvers instead: an
    adapter weightd does not know, when vLLM has others that may (both doors ask this)."""
    return exc.status == HTTPStatus.NOT_FOUND and others_may_resolve()


def others_may_resolve() -> bool:
    """Whether vLLM asks resolvers (its development switch) and has others than weightd's."""
    from vllm import envs

    others = set(LoRAResolverRegistry.get_supported_resolvers()) - {RESOLVER_NAME}
    return bool(envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING) and bool(others)


def register_resolver() -> None:
    """Make the ``weightd`` resolver known to vLLM (idempotent)."""
    if RESOLVER_NAME not in LoRAResolverRegistry.get_supported_resolvers():
        LoRAResolverRegistry.register_resolver(RESOLVER_NAME, WeightdLoRAResolver())
