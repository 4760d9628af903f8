"""reference/python-api.md: ``weightd.client``'s public names, from its ``__all__``, and
what a vLLM user touches of ``weightd.vllm``.

The page is a list of mkdocstrings directives, one per exported name, grouped by
what the name is; mkdocstrings renders each from its docstring and signature.
``weightd.vllm`` has no ``__all__`` (vLLM finds it through its plugin entry point):
its part lists, feature by feature, what a user names in vLLM's settings or calls.
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


#: ``weightd.vllm`` by feature: the names a user passes to vLLM or calls, and the
#: errors they see. Every name must import (``tests/docs/test_python_api_vllm.py``).
VLLM: dict[str, list[str]] = {
    "Plugin": ["weightd.vllm.register"],
    "Loader (`--load-format weightd`)": [
        "weightd.vllm.loader.options.LoaderOptions",
        "weightd.vllm.loader.options.parse_options",
    ],
    "LoRA (`WEIGHTD_LORA`, `--middleware`)": [
        "weightd.vllm.lora.options.LoRAOptions",
        "weightd.vllm.lora.options.parse_lora_options",
        "weightd.vllm.lora.middleware.WeightdLoRAMiddleware",
        "weightd.vllm.lora.hub.AdapterCopy",
    ],
    'Weight transfer (`weight_transfer_config={"backend": "weightd"}`)': [
        "weightd.vllm.transfer.engine.WeightdInitInfo",
        "weightd.vllm.transfer.engine.WeightdUpdateInfo",
        "weightd.vllm.transfer.engine.UpdateReport",
        "weightd.vllm.transfer.rl.update_info",
        "weightd.vllm.transfer.rl.update_llm",
    ],
    "Errors": [
        "weightd.vllm.errors.WeightdVLLMError",
        "weightd.vllm.errors.SettingsError",
        "weightd.vllm.errors.WeightdLoadError",
        "weightd.vllm.errors.WeightdUpdateError",
        "weightd.vllm.errors.AdapterUnavailable",
    ],
}


def _section(title: str, names: list[str]) -> list[str]:
    """One heading and a directive per dotted name (errors without their members)."""
    if not names:
        return []
    out = ["", f"## {title}", ""]
    for name in names:
        out.append(f"::: {name}")
        if title.endswith("Errors"):
            out += ["    options:", "      members: false", "      show_bases: true"]
        out.append("")
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
    sections = {title: [f"weightd.client.{n}" for n in names] for title, names in groups().items()}
    for title, names in sections.items():
        out += _section(title, names)
    out += [
        "",
        "## `weightd.vllm`",
        "",
        'vLLM\'s plugin (`pip install "weightd[vllm]"`): one package per vLLM plug point '
        "(`loader/`, `lora/`, `transfer/`) over the share-fetching code they use "
        "(`share/`), one settings reader and one error hierarchy; the "
        "[vLLM guide](../guides/vllm.md) says how to use each.",
    ]
    for title, names in VLLM.items():
        out += _section(f"`weightd.vllm`: {title}", names)
    return "\n".join(out) + "\n"
