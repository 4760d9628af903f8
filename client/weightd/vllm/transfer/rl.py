"""The engine side of a reinforcement-learning loop, for vLLM's offline ``LLM``.

A trainer publishes (``weightd publish``, :meth:`weightd.client.AdminClient.publish`);
a controller next to each engine learns of the version (``WeightClient.watch_versions``)
and moves the engine to it with :func:`update_llm`. Over HTTP the same three calls are
vLLM's ``/start_weight_update``, ``/update_weights`` and ``/finish_weight_update``
routes (see ``docs/guides/rl-weight-updates.md``).
"""

from __future__ import annotations

from typing import Any

from ..errors import WeightdUpdateError


def update_info(
    version: int,
    *,
    model: str | None = None,
    target: str | None = None,
    transport: str | None = None,
    timeout: float | None = None,
    verify: bool | None = None,
) -> dict[str, Any]:
    """The ``update_info`` of the ``weightd`` backend for one update (unset keys omitted)."""
    info: dict[str, Any] = {"version": version}
    for key, value in (
        ("model", model),
        ("target", target),
        ("transport", transport),
        ("timeout", timeout),
        ("verify", verify),
    ):
        if value is not None:
            info[key] = value
    return info


def update_llm(
    llm: Any,
    version: int,
    *,
    model: str | None = None,
    target: str | None = None,
    transport: str | None = None,
    timeout: float | None = None,
    verify: bool | None = None,
    per_rank: list[dict[str, Any]] | None = None,
) -> str:
    """Move a running ``vllm.LLM`` (built with ``weight_transfer_config={"backend":
    "weightd"}``) to ``version`` of ``model``: every rank, or none.

    On success every parameter of every rank equals a fresh engine's on that version
    (tied embeddings included: see ``docs/guides/rl-weight-updates.md``), the engine's
    weight version is the daemon's version number (returned) and its prefix cache is
    cleared (cached blocks were computed with the old weights). On failure it raises
    :class:`~weightd.vllm.errors.WeightdUpdateError` (naming the rank(s), the model and
    the version; the engine keeps the weights it had, unless the message says
    otherwise).

    ``per_rank``: one dict of overrides per worker (by global rank), for where each rank
    reads from: another ``target`` per host (each host's own daemon), ``transport``,
    ``timeout``, ``verify``. Every rank must take the same content: a ``version`` or
    ``model`` that differs between ranks, or daemons whose same version number holds
    other bytes, is refused on every rank before any fetches a byte.
    """
    base = update_info(
        version, model=model, target=target, transport=transport, timeout=timeout, verify=verify
    )
    payload: dict[str, Any] | list[dict[str, Any]] = base
    if per_rank is not None:
        payload = [{**base, **extra} for extra in per_rank]
    llm.start_weight_update()
    try:
        llm.update_weights({"update_info": payload})
    except Exception as exc:  # vLLM wraps a worker's error in a plain Exception
        ours = WeightdUpdateError.from_vllm(exc)
        if ours is None:
            raise
        raise ours from exc
    llm.finish_weight_update(weight_version=str(version))
    llm.reset_prefix_cache()
    return str(llm.get_weight_version())
