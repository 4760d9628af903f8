"""reference/python-api.md: ``weightd.client``'s public names, from its ``__all__``.

The page is a list of mkdocstrings directives, one per exported name, grouped by
what the name is; mkdocstrings renders each from its docstring and signature.
"""

from __future__ import annotations

import inspect

from . import banner


def groups() -> dict[str, list[str]]:
    """``weightd.client.__all__`` by kind: clients, data types, functions, errors."""
    from weightd import client

    out: dict[str, list[str]] = {"Clients": [], "Data types": [], "Functions": [], "Errors": []}
    for name in client.__all__:
        obj = getattr(client, name)
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            out["Errors"].append(name)
        elif inspect.isclass(obj) and name.endswith("Client"):
            out["Clients"].append(name)
        elif inspect.isclass(obj):
            out["Data types"].append(name)
        else:
            out["Functions"].append(name)
    out["Clients"].sort(key=lambda n: n != "WeightClient")  # the one most readers need
    out["Errors"].sort(key=lambda n: n != "WeightdError")  # the base first
    return out


def render() -> str:
    out = [
        "# Python API",
        "",
        banner("weightd.client.__all__ and its docstrings"),
        "",
        "Everything a worker imports comes from `weightd.client` (it needs grpcio, "
        "protobuf and torch only, never the daemon's dependencies). The names below are "
        "its whole public surface, its `__all__`; how to use them is in the "
        "[client guide](../guides/client.md).",
    ]
    for title, names in groups().items():
        if not names:
            continue
        out += ["", f"## {title}", ""]
        for name in names:
            out.append(f"::: weightd.client.{name}")
            if title == "Errors":
                out += ["    options:", "      members: false", "      show_bases: true"]
            out.append("")
    return "\n".join(out) + "\n"
