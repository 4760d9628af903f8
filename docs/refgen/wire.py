"""reference/wire.md: the wire contract, from ``proto/weightd/v1/*.proto`` and their
comments (compiled by ``grpc_tools.protoc`` with source info, so every comment is
read exactly as protoc attaches it to its service, method, message, field or enum)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import ROOT, banner

# Paths into a FileDescriptorProto, as SourceCodeInfo.Location.path numbers them.
_MESSAGE, _ENUM, _SERVICE = 4, 5, 6
_FIELD, _NESTED, _NESTED_ENUM = 2, 3, 4
_VALUE, _METHOD = 2, 2


def descriptor_set(proto_dir: Path) -> Any:
    """Compile every .proto under ``proto_dir`` into a FileDescriptorSet with comments."""
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    files = sorted(str(p.relative_to(proto_dir)) for p in proto_dir.rglob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        status = protoc.main(
            [
                "protoc",
                f"-I{proto_dir}",
                "--include_source_info",
                f"--descriptor_set_out={out}",
                *files,
            ]
        )
        if status != 0:
            raise RuntimeError(f"protoc failed on {proto_dir} (status {status})")
        result = descriptor_pb2.FileDescriptorSet()
        result.ParseFromString(out.read_bytes())
    return result


def _comments(file: Any) -> dict[tuple[int, ...], str]:
    out: dict[tuple[int, ...], str] = {}
    for loc in file.source_code_info.location:
        text = "\n".join(
            part.strip("\n") for part in (loc.leading_comments, loc.trailing_comments) if part
        )
        if text:
            joined = " ".join(line.strip() for line in text.splitlines())
            # Comments are plain text: `<hex>` must not become an HTML tag.
            out[tuple(loc.path)] = (
                joined.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            )
    return out


_SCALARS = {
    1: "double", 2: "float", 3: "int64", 4: "uint64", 5: "int32", 6: "fixed64",
    7: "fixed32", 8: "bool", 9: "string", 12: "bytes", 13: "uint32", 15: "sfixed32",
    16: "sfixed64", 17: "sint32", 18: "sint64",
}  # fmt: skip


def _type(field: Any, maps: dict[str, Any]) -> str:
    if field.type_name:
        name = field.type_name.lstrip(".")
        entry = maps.get(name)
        if entry is not None:
            key, value = entry.field
            return f"map&lt;{_type(key, maps)}, {_type(value, maps)}&gt;"
        return f"[{name.rsplit('.', 1)[-1]}](#{_anchor(name)})"
    return _SCALARS.get(field.type, str(field.type))


def _anchor(full_name: str) -> str:
    return full_name.replace(".", "-").lower()


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _messages(
    messages: Any, prefix: str, path: tuple[int, ...]
) -> Iterator[tuple[str, Any, tuple[int, ...]]]:
    for i, m in enumerate(messages):
        full = f"{prefix}.{m.name}"
        where = (*path, i)
        yield full, m, where
        yield from _messages(m.nested_type, full, (*where, _NESTED))


def _render_enum(e: Any, full: str, where: tuple[int, ...], notes: dict[Any, str]) -> list[str]:
    out = ["", f"### enum `{full.split('.', 2)[-1]}` {{#{_anchor(full)}}}", ""]
    if notes.get(where):
        out += [notes[where], ""]
    out += ["| value | number | |", "|---|---|---|"]
    for k, v in enumerate(e.value):
        out.append(f"| `{v.name}` | {v.number} | {_cell(notes.get((*where, _VALUE, k), ''))} |")
    return out


def _header(file: Any) -> str:
    """The file's opening comment (attached to ``syntax`` or ``package``), lines kept."""
    for loc in file.source_code_info.location:
        if tuple(loc.path) in ((12,), (2,)):
            text = loc.leading_comments or "".join(loc.leading_detached_comments)
            if text.strip():
                return "\n".join(
                    line[1:] if line.startswith(" ") else line
                    for line in text.strip("\n").splitlines()
                )
    return ""


def render_file(file: Any) -> list[str]:
    notes = _comments(file)
    package = file.package
    out = ["", f"## `{file.name}`", ""]
    header = _header(file)
    if header:
        out += ["```text", header, "```", ""]
    for s_index, service in enumerate(file.service):
        full = f"{package}.{service.name}"
        out += ["", f"### service `{service.name}` {{#{_anchor(full)}}}", ""]
        if notes.get((_SERVICE, s_index)):
            out += [notes[(_SERVICE, s_index)], ""]
        out += ["| method | request | response | |", "|---|---|---|---|"]
        for m_index, method in enumerate(service.method):
            request = method.input_type.lstrip(".")
            response = method.output_type.lstrip(".")
            req = f"[{request.rsplit('.', 1)[-1]}](#{_anchor(request)})"
            resp = f"[{response.rsplit('.', 1)[-1]}](#{_anchor(response)})"
            if method.client_streaming:
                req = "stream " + req
            if method.server_streaming:
                resp = "stream " + resp
            note = notes.get((_SERVICE, s_index, _METHOD, m_index), "")
            out.append(f"| `{method.name}` | {req} | {resp} | {_cell(note)} |")
    all_messages = list(_messages(file.message_type, package, (_MESSAGE,)))
    maps = {full: m for full, m, _ in all_messages if m.options.map_entry}
    for full, message, where in all_messages:
        if message.options.map_entry:
            continue
        out += ["", f"### message `{full.split('.', 2)[-1]}` {{#{_anchor(full)}}}", ""]
        if notes.get(where):
            out += [notes[where], ""]
        if message.field:
            out += ["| field | number | type | |", "|---|---|---|---|"]
            for f_index, field in enumerate(message.field):
                kind = _type(field, maps)
                if field.label == 3 and not kind.startswith("map&lt;"):
                    kind = "repeated " + kind
                note = notes.get((*where, _FIELD, f_index), "")
                out.append(f"| `{field.name}` | {field.number} | {kind} | {_cell(note)} |")
        else:
            out.append("*No fields.*")
        for e_index, enum in enumerate(message.enum_type):
            out += _render_enum(enum, f"{full}.{enum.name}", (*where, _NESTED_ENUM, e_index), notes)
    for e_index, enum in enumerate(file.enum_type):
        out += _render_enum(enum, f"{package}.{enum.name}", (_ENUM, e_index), notes)
    return out


def render() -> str:
    out = [
        "# Wire contract (`weightd.v1`)",
        "",
        banner("proto/weightd/v1/*.proto"),
        "",
        "The gRPC services and messages, with the comments of the `.proto` files they come "
        "from. Evolution rule: fields are only added (never renumbered or retyped), so "
        "old clients and old daemons keep working; a field a peer predates reads as its "
        "zero value, and each such field says what that means. The Python stubs "
        "(`weightd.v1`) are generated from these files by `.ci/gen-proto` and committed; "
        "the test command fails when they drift. The standard `grpc.health.v1` service "
        "reports each model as `weightd.v1.Weights/<model>`.",
    ]
    for file in descriptor_set(ROOT / "proto").file:
        out += render_file(file)
    return "\n".join(out) + "\n"
