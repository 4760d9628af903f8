"""reference/errors.md: the daemon's error classes and their status codes, from
``weightd.server.base.errors`` (and every subclass defined elsewhere in the daemon),
and the exceptions a Python client raises, from ``weightd.client.base.errors``."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections import defaultdict
from collections.abc import Iterator

from . import banner, plain


def _import_daemon() -> None:
    """Import every daemon module, so subclasses declared outside base/errors.py count."""
    import weightd.server

    for module in pkgutil.walk_packages(weightd.server.__path__, "weightd.server."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)


def _tree(cls: type, depth: int = 0) -> Iterator[tuple[int, type]]:
    for sub in sorted(cls.__subclasses__(), key=lambda c: (c.__module__, _line(c))):
        if sub.__name__.startswith("_"):
            continue
        yield depth, sub
        yield from _tree(sub, depth + 1)


def _line(cls: type) -> int:
    try:
        return inspect.getsourcelines(cls)[1]
    except (OSError, TypeError):
        return 0


def _summary(cls: type) -> str:
    doc = inspect.getdoc(cls) if "__doc__" in cls.__dict__ else None
    if not doc:
        return ""
    return plain(doc)


def _where(cls: type) -> str:
    module = cls.__module__.removeprefix("weightd.server.")
    return "" if module == "base.errors" else f" *({module})*"


def render() -> str:
    _import_daemon()
    import weightd.client.base.errors as client_errors
    from weightd.server.base import errors

    out = [
        "# Errors and status codes",
        "",
        banner("weightd.server.base.errors and weightd.client.base.errors"),
        "",
        "Every failure the daemon can explain is a class of one hierarchy "
        "(`weightd.server.base.errors.WeightdError`); the class fixes the gRPC status "
        "code, and its message names the model, file, tensor or field at fault. Every "
        "edge (the gRPC servicers, the same-host side channel, the CLI) turns a failure "
        "into a status through one function, `status_for`; anything that is not one of "
        "these classes is a bug and answers `INTERNAL`, with its traceback in the "
        "daemon's log. A caller's mistake is never `INTERNAL`.",
        "",
        "## By status code",
        "",
        "| code | daemon classes answering it |",
        "|---|---|",
    ]
    tree = [(0, errors.WeightdError), *((d + 1, c) for d, c in _tree(errors.WeightdError))]
    by_code: dict[str, list[str]] = defaultdict(list)
    for _, cls in tree:
        code = getattr(cls, "code", None)
        if code is not None:
            by_code[code.name].append(f"[`{cls.__name__}`](#{cls.__name__.lower()})")
    for code in errors.Code:
        if code.name in by_code:
            out.append(f"| `{code.name}` ({int(code)}) | {', '.join(by_code[code.name])} |")
    out += [
        "",
        "## The hierarchy",
        "",
        "Indented classes are subclasses; a class answers its own code, which may differ "
        "from its parent's. Catching a parent catches every class below it.",
        "",
    ]
    for depth, cls in tree:
        code = getattr(cls, "code", None)
        code_text = f"`{code.name}`" if code is not None else ""
        summary = _summary(cls)
        out.append(
            f'{"    " * depth}- <a id="{cls.__name__.lower()}"></a>**`{cls.__name__}`** '
            f"{code_text}{_where(cls)}{': ' + summary if summary else ''}"
        )
    out += [
        "",
        "## What a Python client raises",
        "",
        "`weightd.client` raises subclasses of its own `weightd.client.WeightdError`, "
        "chosen by the daemon's error class (sent with every status as "
        "`google.rpc.ErrorInfo`, and on the side socket) and, from a daemon that "
        "predates it, by the status code (or the code the daemon would have used, for "
        "what the client detects itself: a digest mismatch, a stream cut short). Each "
        "carries `.code` (a `grpc.StatusCode`; `.code_name` its name), `.detail` (the "
        "daemon's message), `.reason` and `.metadata` (the daemon's class and fields) "
        'and `.transport` (`"shm"` or `"cuda_ipc"` when a same-host transport failed '
        "on its own and gRPC may still serve the request). "
        "See also [Errors](../guides/errors.md) and the [Python API](python-api.md).",
        "",
        "| client class | parent | code | when |",
        "|---|---|---|---|",
    ]
    base = client_errors.WeightdError
    for _, cls in [(0, base), *_tree(base)]:
        parent = cls.__mro__[1].__name__
        code_name = getattr(cls, "code_name", "")
        code_text = f"`{code_name}`" if code_name else ""
        out.append(f"| `{cls.__name__}` | `{parent}` | {code_text} | {_summary(cls)} |")
    return "\n".join(out) + "\n"
