"""The middleware's request handling that needs no server: reading a bounded body,
handing it on unchanged, finding the ``model`` it names (pure, asyncio only)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from weightd.vllm.lora.middleware import _model_of, _read, _replay


def receiver(parts: list[bytes], then: str = "http.disconnect") -> Any:
    messages = [
        {"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
        for i, p in enumerate(parts)
    ]
    messages.append({"type": then})

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    return receive


@pytest.mark.parametrize(
    ("parts", "limit", "body", "more"),
    [
        ([b'{"model": "a"}'], 100, b'{"model": "a"}', False),
        ([b'{"mod', b'el": "a"}'], 100, b'{"model": "a"}', False),
        ([b"x" * 60, b"y" * 60, b"z"], 100, b"x" * 60 + b"y" * 60, True),  # over: stop reading
        ([], 100, b"", False),
    ],
)
def test_read_is_bounded_and_replayed_whole(
    parts: list[bytes], limit: int, body: bytes, more: bool
) -> None:
    async def run() -> bytes:
        receive = receiver(parts)
        got, more_body = await _read(receive, limit)
        assert (got, more_body) == (body, more)
        replay = _replay(got, more_body, receive)
        seen = b""
        while True:
            message = await replay()
            if message["type"] != "http.request":
                break
            seen += message.get("body", b"")
            if not message.get("more_body"):
                break
        return seen

    assert asyncio.run(run()) == b"".join(parts)


@pytest.mark.parametrize(
    ("body", "model"),
    [
        (b'{"model": "sql-lora", "prompt": [1]}', "sql-lora"),
        (b'{"model": ""}', None),
        (b'{"model": 3}', None),
        (b'["model"]', None),
        (b"not json", None),
        (b"\xff\xfe", None),
        (b"", None),
        (b'{"model": ' + b"[" * 100_000, None),  # nested too deep: no traceback out of it
    ],
)
def test_model_of(body: bytes, model: str | None) -> None:
    assert _model_of(body) == model
