"""weightd adapters in vLLM's OpenAI server without its development switch, hot-swapped.

``--middleware weightd.vllm.lora.middleware.WeightdLoRAMiddleware`` (vLLM's documented
way to add ASGI middleware to its API server). For each POST whose JSON body names a
``model`` that is neither a served base model nor an adapter vLLM was given some other
way (``--lora-modules``), before vLLM handles the request:

1. the daemon is asked for the adapter's current version (:mod:`.hub`: loaded on
   request if its operator allows it; the files verified and copied privately);
2. if vLLM does not already serve that version under the name, it is loaded into the
   engine with ``engine_client.add_lora`` (every worker loads it now, and a refusal is
   an error for this request, never a failed engine step), and only then put in
   vLLM's table of adapters by name (``OpenAIServingModels.lora_requests``), under
   vLLM's own per-name lock;
3. vLLM handles the request as for any adapter it holds: it takes that table's entry.

So **a request checked after the daemon published a new version gets the new
version** (requests that arrive while a check is in flight share it: at most one
daemon round trip earlier), requests already in the engine keep the version they
were given (each carries its own ``LoRARequest``: name, id, path), and no prefix-cache
block is shared between versions (the version is in ``lora_name`` and ``lora_path``).
An adapter the daemon no longer has (unloaded, evicted and not loadable on request)
is dropped from the table: later requests get 404, requests in flight finish.

Refusals are answered here, as vLLM answers errors (``{"error": {"message", "type",
"param", "code"}}``, paths in the message masked as vLLM masks them): 404 unknown,
400 refused (tampered, digest mismatch, another base model, ...), 503 daemon
unreachable or over its budget. Bodies over :data:`MAX_INSPECT_BYTES` are passed to
vLLM uninspected. A name unknown to weightd is passed on to vLLM when vLLM asks
resolvers (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) and has others (its filesystem or Hub
resolver), so they coexist.

Costs: every request's JSON body is parsed once more (vLLM parses it again), and a
request naming a weightd adapter waits for one unary daemon call (``ResolveAdapter``,
about a millisecond on the daemon's Unix socket) before vLLM sees it. It relies on
two attributes of vLLM's API server state (``app.state.openai_serving_models`` with
``lora_requests``, ``lora_resolver_lock``, ``lora_id_counter``, ``engine_client``),
read from vLLM 0.32's source; it passes requests through untouched if they are absent.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from http import HTTPStatus
from typing import Any, Final

from ..errors import AdapterUnavailable
from .hub import AdapterCopy, hub
from .refusals import error_type, not_loaded

log = logging.getLogger("vllm.weightd.lora")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: Request bodies read to find their ``model``; longer ones go to vLLM uninspected.
MAX_INSPECT_BYTES: Final = 16 << 20


class WeightdLoRAMiddleware:
    """ASGI middleware; vLLM instantiates it with the app (``--middleware``)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        body, more = await _read(receive, MAX_INSPECT_BYTES)
        models = getattr(getattr(scope.get("app"), "state", None), "openai_serving_models", None)
        name = None if more or models is None else _model_of(body)
        if name is not None and _is_weightd_name(models, name):
            try:
                await ensure(models, name)
            except AdapterUnavailable as exc:
                if not _left_to_others(exc):
                    await _error(send, exc)
                    return
                # Unknown to weightd: vLLM's other resolvers get their turn.
        await self.app(scope, _replay(body, more, receive), send)


def _left_to_others(exc: AdapterUnavailable) -> bool:
    from .resolver import left_to_others  # imports vLLM's resolver registry

    return left_to_others(exc)


def _is_weightd_name(models: Any, name: str) -> bool:
    """Whether a request for ``name`` is weightd's to serve: not a base model, not an
    adapter vLLM got some other way."""
    if not hasattr(models, "lora_requests") or models.is_base_model(name):
        return False
    held = models.lora_requests.get(name)
    return held is None or hub().owns(held.lora_path)


async def ensure(models: Any, name: str) -> None:
    """Make vLLM's entry for ``name`` the daemon's current version (see the module doc)."""
    h = hub()
    try:
        prepared = await h.current(name, getattr(models.model_config, "model", None))
    except AdapterUnavailable as exc:
        if exc.status == HTTPStatus.NOT_FOUND:
            await _drop(models, name)
        raise
    held = models.lora_requests.get(name)
    if held is not None and held.lora_path == prepared.path:
        return
    async with models.lora_resolver_lock[name]:
        held = models.lora_requests.get(name)
        if held is not None and (
            held.lora_path == prepared.path
            or not h.owns(held.lora_path)
            or h.newer(held.lora_path, prepared.path)  # a newer one won the race
        ):
            return
        await _install(models, prepared, held)


async def _install(models: Any, prepared: AdapterCopy, held: Any) -> None:
    from vllm.lora.request import LoRARequest

    request = LoRARequest(
        lora_name=prepared.lora_name,
        lora_int_id=models.lora_id_counter.inc(1),
        lora_path=prepared.path,
    )
    started = time.monotonic()
    try:
        await models.engine_client.add_lora(request)
    except Exception as exc:
        raise not_loaded(prepared.name, prepared.version, exc) from None
    models.lora_requests[prepared.name] = request
    if held is not None:
        hub().retire(held.lora_path)
    log.info(
        "weightd: adapter %r version %d (%s) serves new requests (was: %s); vLLM loaded it "
        "in %.3f s",
        prepared.name,
        prepared.version,
        prepared.digest,
        held.lora_name if held is not None else "none",
        time.monotonic() - started,
    )


async def _drop(models: Any, name: str) -> None:
    if name not in models.lora_requests:
        # Never ours: no lock is made for it (vLLM's lock table would grow with every
        # unknown name a client sends).
        return
    async with models.lora_resolver_lock[name]:
        held = models.lora_requests.get(name)
        if held is not None and hub().owns(held.lora_path):
            del models.lora_requests[name]
            hub().retire(held.lora_path)
            log.info("weightd: adapter %r gone from the daemon: %s dropped", name, held.lora_name)


def _model_of(body: bytes) -> str | None:
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested too deep: vLLM answers it
        return None
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return model if isinstance(model, str) and model else None


async def _read(receive: Receive, limit: int) -> tuple[bytes, bool]:
    """The body, up to about ``limit`` bytes; ``more`` when the client has sent more."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(parts), False  # disconnected: vLLM sees an empty body
        chunk = message.get("body", b"")
        parts.append(chunk)
        size += len(chunk)
        more = bool(message.get("more_body", False))
        if not more or size > limit:
            return b"".join(parts), more


def _replay(body: bytes, more: bool, receive: Receive) -> Receive:
    """``receive`` for the app: what was read, then the rest from the client."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": more}
        return await receive()

    return replay


async def _error(send: Send, exc: AdapterUnavailable) -> None:
    from vllm.entrypoints.serve.exception_handling.utils import sanitize_message

    body = json.dumps(
        {
            "error": {
                "message": sanitize_message(exc.message),
                "type": error_type(exc.status),
                "param": "model",
                "code": exc.status,
            }
        }
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
