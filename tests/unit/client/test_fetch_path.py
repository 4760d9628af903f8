"""The fetch path passes two values down, not a dozen keywords (issue 47).

Every function a fetch goes through, from ``WeightClient.fetch`` to the side channel's
wire encoding and the gRPC resume loop, takes at most six arguments by keyword: what
is fetched travels as one :class:`Wanted` and how it is delivered as one
:class:`Delivery`, so a new fetch option is one field, not an edit of every call.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import pytest

from weightd.client import (
    Delivery,
    DeliveryOptions,
    InvalidArgumentError,
    Layout,
    Wanted,
    WeightClient,
)
from weightd.client.api import adapters
from weightd.client.base.request import DELIVERY_KEYWORDS, tp_layout
from weightd.client.receive.stream import RankReceiver
from weightd.client.transports import (
    cuda_ipc,
    local_fetch,
    localwire,
    resumable,
    shm,
    streams,
)
from weightd.client.transports.local import LocalConnection

#: The calls a fetch makes, in order, for every public entry point and transport.
FETCH_PATH: list[Callable[..., Any]] = [
    WeightClient.fetch,
    WeightClient.fetch_with_info,
    WeightClient.fetch_layout,
    WeightClient.fetch_adapter,
    WeightClient.load_into,
    WeightClient.attach,
    WeightClient._delivery,
    WeightClient._fetch_negotiated,
    WeightClient._fetch_grpc_streams,
    WeightClient._fetch_grpc,
    adapters.fetch_adapter_via,
    adapters.fetch_adapter,
    local_fetch.negotiated_fetch,
    local_fetch.fetch_local,
    local_fetch.attach_local,
    local_fetch._map,
    LocalConnection.request,
    localwire.encode_acquire,
    shm.map_host_pack,
    cuda_ipc.map_cuda_pack,
    resumable.fetch_resumable,
    RankReceiver.for_request,
    streams.fetch_in_streams,
]

MOST_KEYWORDS = 6


def keywords(fn: Callable[..., Any]) -> list[str]:
    """The arguments a caller can pass by keyword (``self`` aside; ``**options`` counts once)."""
    kinds = (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
        inspect.Parameter.VAR_KEYWORD,
    )
    params = inspect.signature(fn).parameters.values()
    return [p.name for p in params if p.kind in kinds and p.name not in ("self", "cls")]


@pytest.mark.parametrize("fn", FETCH_PATH, ids=lambda f: f.__qualname__)
def test_no_call_on_the_fetch_path_takes_more_than_six_keywords(fn: Callable[..., Any]) -> None:
    names = keywords(fn)
    assert len(names) <= MOST_KEYWORDS, f"{fn.__qualname__} takes {len(names)}: {names}"


def test_the_keywords_a_fetch_takes_are_fields_of_the_delivery() -> None:
    fields = {f.name for f in dataclasses.fields(Delivery)}
    assert set(DeliveryOptions.__optional_keys__) == DELIVERY_KEYWORDS
    assert fields >= DELIVERY_KEYWORDS
    # What the client decides itself is not a caller's keyword.
    assert fields - DELIVERY_KEYWORDS == {"into", "populate"}


def test_public_fetch_calls_still_take_their_keywords() -> None:
    """Users call ``fetch(..., transport=..., device=..., copy=..., verify=..., streams=...)``."""
    for fn in (WeightClient.fetch, WeightClient.fetch_with_info, WeightClient.fetch_layout):
        params = inspect.signature(fn).parameters
        assert params["delivery"].kind is inspect.Parameter.VAR_KEYWORD
        assert {"model", "names"} <= set(params)
    delivery = Delivery.of(
        {"transport": "shm", "device": "cpu", "copy": True, "verify": True, "streams": 2},
        populate=False,
    )
    assert delivery == Delivery("shm", "cpu", True, True, 2, populate=False)


def test_an_unknown_keyword_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match=r"\['copies'\]"):
        Delivery.of({"copies": True})  # type: ignore[typeddict-unknown-key]
    client = WeightClient("unix:///nonexistent/weightd.sock")
    try:
        with pytest.raises(TypeError, match="into"):  # the client's own field, not a keyword
            client.fetch(0, 1, into={})  # type: ignore[call-arg]
    finally:
        client.close()


def test_a_bad_rank_is_refused_before_anything_is_built() -> None:
    assert tp_layout(1, 2) == Layout(tp_size=2, tp_rank=1)
    with pytest.raises(InvalidArgumentError, match="rank 2 / world_size 2 is invalid"):
        tp_layout(2, 2)
    assert Wanted(Layout()).names == () and Wanted(Layout()).version == 0
