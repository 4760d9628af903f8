"""The malformed-input corpus: each case breaks one rule of a valid checkpoint.

A case builds its broken checkpoint (and, for trust cases, a manifest or key) under a
temporary directory and says which typed error must come first, which file the
message must name, and which tensor or field it must name.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.trust import craft
from tests.trust.craft import INDEX, SHARD1, SHARD2, encode, entries, shard_tensors
from weightd.server.base import errors as err


@dataclass
class Keys:
    private: Path
    public: Path
    other_private: Path
    other_public: Path


@dataclass
class Setup:
    model: Path
    manifest: Path | None = None
    trust_keys: list[Path] = field(default_factory=list)
    hf: bool = False

    def cli_args(self) -> list[str]:
        out: list[str] = []
        if self.manifest is not None:
            out += ["--manifest", str(self.manifest)]
        for k in self.trust_keys:
            out += ["--trust-key", str(k)]
        if self.hf:
            out.append("--trust-hf-cache")
        return out


@dataclass(frozen=True)
class Case:
    id: str
    family: str  # header, index, path, config, manifest, signature, hfcache
    build: Callable[[Path, Keys], Setup]
    error: type[err.WeightdError]
    file: str  # the message names this file
    what: str  # ... and this tensor or field


CASES: list[Case] = []


def case(
    family: str, error: type[err.WeightdError], file: str, what: str
) -> Callable[[Callable[[Path, Keys], Setup]], Callable[[Path, Keys], Setup]]:
    def register(fn: Callable[[Path, Keys], Setup]) -> Callable[[Path, Keys], Setup]:
        CASES.append(Case(fn.__name__, family, fn, error, file, what))
        return fn

    return register


def base(tmp: Path) -> Path:
    return craft.write_checkpoint(tmp / "model")


def _shard2(tmp: Path, raw: bytes) -> Setup:
    d = base(tmp)
    (d / SHARD2).write_bytes(raw)
    return Setup(d)


def _header2(tmp: Path, text: str, data: bytes | None = None) -> Setup:
    """Shard 2 with header ``text`` and (by default) its original data section."""
    _, original = entries(shard_tensors(SHARD2))
    return _shard2(tmp, encode(text, original if data is None else data))


def _mutated2(
    tmp: Path, mutate: Callable[[dict[str, Any]], None], data: bytes | None = None
) -> Setup:
    header, original = entries(shard_tensors(SHARD2))
    mutate(header)
    return _shard2(tmp, encode(header, original if data is None else data))


NORM = "model.norm.weight"
DOWN = "model.layers.0.mlp.down_proj.weight"
GATE = "model.layers.0.mlp.gate_proj.weight"


# --- headers ----------------------------------------------------------------------------


@case("header", err.HeaderLengthError, SHARD2, "header length")
def file_shorter_than_8_bytes(tmp: Path, k: Keys) -> Setup:
    return _shard2(tmp, b"\x10\x00\x00")


@case("header", err.HeaderLengthError, SHARD2, "header length")
def header_length_over_cap(tmp: Path, k: Keys) -> Setup:
    return _shard2(tmp, struct.pack("<Q", 1 << 40) + b"{}" * 8)


@case("header", err.HeaderLengthError, SHARD2, "header length")
def header_length_past_file(tmp: Path, k: Keys) -> Setup:
    header, data = entries(shard_tensors(SHARD2))
    raw = encode(header, data)
    return _shard2(tmp, struct.pack("<Q", len(raw)) + raw[8:])


@case("header", err.HeaderEncodingError, SHARD2, "header")
def header_not_utf8(tmp: Path, k: Keys) -> Setup:
    return _shard2(tmp, encode(b'{"\xff\xfe": 1}', b""))


@case("header", err.HeaderSyntaxError, SHARD2, "header")
def header_not_json(tmp: Path, k: Keys) -> Setup:
    return _header2(tmp, '{"a": ')


@case("header", err.HeaderSyntaxError, SHARD2, "JSON object")
def header_not_an_object(tmp: Path, k: Keys) -> Setup:
    return _header2(tmp, "[1, 2, 3]")


@case("header", err.DuplicateKeyError, SHARD2, NORM)
def duplicate_tensor_key(tmp: Path, k: Keys) -> Setup:
    header, data = entries(shard_tensors(SHARD2))
    text = json.dumps(header)
    entry = json.dumps(header[NORM])
    # the same tensor again, pointing at other bytes (the reference parser keeps the last)
    text = text[:-1] + f', "{NORM}": {entry}}}'
    return _header2(tmp, text, data)


@case("header", err.DuplicateKeyError, SHARD2, "__metadata__")
def duplicate_metadata_key(tmp: Path, k: Keys) -> Setup:
    header, data = entries(shard_tensors(SHARD2))
    text = json.dumps(header)
    return _header2(tmp, '{"__metadata__": {"a": "b"}, ' + text[1:], data)


@case("header", err.DuplicateKeyError, SHARD2, "'dtype'")
def duplicate_field_in_entry(tmp: Path, k: Keys) -> Setup:
    header, data = entries(shard_tensors(SHARD2))
    text = json.dumps(header).replace('{"dtype": "F32"', '{"dtype": "F16", "dtype": "F32"', 1)
    return _header2(tmp, text, data)


@case("header", err.NonFiniteNumberError, SHARD2, NORM)
def nan_in_shape(tmp: Path, k: Keys) -> Setup:
    header, data = entries(shard_tensors(SHARD2))
    text = json.dumps(header).replace(
        f'"{NORM}": {{"dtype": "F32", "shape": [4]', f'"{NORM}": {{"dtype": "F32", "shape": [NaN]'
    )
    assert "NaN" in text
    return _header2(tmp, text, data)


@case("header", err.NonFiniteNumberError, SHARD2, "__metadata__")
def infinity_in_metadata(tmp: Path, k: Keys) -> Setup:
    header, data = entries(shard_tensors(SHARD2))
    text = json.dumps(header).replace('{"format": "pt"}', '{"format": Infinity}')
    return _header2(tmp, text, data)


def _rename(old: str, new: str) -> Callable[[dict[str, Any]], None]:
    def mutate(h: dict[str, Any]) -> None:
        h[new] = h.pop(old)

    return mutate


@case("header", err.TensorNameError, SHARD2, "tensor name ''")
def empty_tensor_name(tmp: Path, k: Keys) -> Setup:
    return _mutated2(tmp, _rename(NORM, ""))


@case("header", err.TensorNameError, SHARD2, "model.norm")
def nul_in_tensor_name(tmp: Path, k: Keys) -> Setup:
    return _mutated2(tmp, _rename(NORM, "model.norm\x00.weight"))


@case("header", err.TensorNameError, SHARD2, "tensor name 'xxxx")
def overlong_tensor_name(tmp: Path, k: Keys) -> Setup:
    return _mutated2(tmp, _rename(NORM, "x" * 5000))


@case("header", err.TensorNameError, SHARD2, "model.norm")
def control_char_in_tensor_name(tmp: Path, k: Keys) -> Setup:
    return _mutated2(tmp, _rename(NORM, "model.norm\x1b[2J.weight"))


def _set(name: str, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(h: dict[str, Any]) -> None:
        h[name][key] = value

    return mutate


@case("header", err.DtypeError, SHARD2, NORM)
def unknown_dtype(tmp: Path, k: Keys) -> Setup:
    return _mutated2(tmp, _set(NORM, "dtype", "F128"))


@case("header", err.ShapeError, SHARD2, NORM)
def negative_shape(tmp: Path, k: Keys) -> Setup:
    return _mutated2(tmp, _set(NORM, "shape", [-4]))


@case("header", err.ShapeError, SHARD2, NORM)
def non_integer_shape(tmp: Path, k: Keys) -> Setup:
    return _mutated2(tmp, _set(NORM, "shape", [4.0]))


@case("header", err.ShapeError, SHARD2, NORM)
def boolean_in_shape(tmp: Path, k: Keys) -> Setup:
    return _mutated2(tmp, _set(NORM, "shape", [True, 4]))


@case("header", err.ShapeError, SHARD2, NORM)
def overflowing_shape(tmp: Path, k: Keys) -> Setup:
    return _mutated2(tmp, _set(NORM, "shape", [1 << 40, 1 << 40, 1 << 40]))


def _offsets(name: str, delta_begin: int, delta_end: int) -> Callable[[dict[str, Any]], None]:
    def mutate(h: dict[str, Any]) -> None:
        b, e = h[name]["data_offsets"]
        h[name]["data_offsets"] = [b + delta_begin, e + delta_end]

    return mutate


@case("header", err.OffsetsError, SHARD2, "lm_head.weight")
def offsets_with_a_gap(tmp: Path, k: Keys) -> Setup:
    # lm_head moved 4 bytes on (an F32 element), file grown to keep it in bounds
    header, data = entries(shard_tensors(SHARD2))
    _offsets("lm_head.weight", 4, 4)(header)
    return _shard2(tmp, encode(header, data + b"\0" * 4))


@case("header", err.OffsetsError, SHARD2, "overlap")
def offsets_overlapping(tmp: Path, k: Keys) -> Setup:
    header, data = entries(shard_tensors(SHARD2))
    last = "lm_head.weight"
    _offsets(last, -4, -4)(header)
    return _shard2(tmp, encode(header, data[:-4]))


@case("header", err.OffsetsError, SHARD2, "share their byte range")
def offsets_shared_range(tmp: Path, k: Keys) -> Setup:
    header, data = entries(shard_tensors(SHARD2))
    header["model.layers.0.mlp.up_proj.weight"]["data_offsets"] = list(header[GATE]["data_offsets"])
    # lay the rest out again after the shared range, so only the sharing is wrong
    cursor = header[GATE]["data_offsets"][1]
    body = bytearray(data[:cursor])
    for name in (DOWN, "model.norm.weight", "lm_head.weight"):
        b, e = header[name]["data_offsets"]
        header[name]["data_offsets"] = [cursor, cursor + (e - b)]
        body += data[b:e]
        cursor += e - b
    return _shard2(tmp, encode(header, bytes(body)))


@case("header", err.OffsetsError, SHARD2, NORM)
def offsets_end_before_begin(tmp: Path, k: Keys) -> Setup:
    def mutate(h: dict[str, Any]) -> None:
        b, e = h[NORM]["data_offsets"]
        h[NORM]["data_offsets"] = [e, b]

    return _mutated2(tmp, mutate)


@case("header", err.OffsetsError, SHARD2, "data_offsets")
def offsets_not_a_pair(tmp: Path, k: Keys) -> Setup:
    return _mutated2(tmp, _set(NORM, "data_offsets", [0, 8, 16]))


@case("header", err.ByteSizeError, SHARD2, NORM)
def byte_size_differs_from_shape(tmp: Path, k: Keys) -> Setup:
    return _mutated2(tmp, _set(NORM, "shape", [3]))


@case("header", err.ByteSizeError, SHARD2, "F4")
def sub_byte_tensor_not_whole_bytes(tmp: Path, k: Keys) -> Setup:
    def mutate(h: dict[str, Any]) -> None:
        h[NORM]["dtype"] = "F4"
        h[NORM]["shape"] = [31]  # 15.5 bytes

    return _mutated2(tmp, mutate)


@case("header", err.DataSectionError, SHARD2, "trailing bytes")
def trailing_bytes_polyglot(tmp: Path, k: Keys) -> Setup:
    header, data = entries(shard_tensors(SHARD2))
    return _shard2(tmp, encode(header, data + b"PK\x05\x06" + b"\0" * 18))


@case("header", err.DataSectionError, SHARD2, "truncated")
def truncated_data_section(tmp: Path, k: Keys) -> Setup:
    header, data = entries(shard_tensors(SHARD2))
    return _shard2(tmp, encode(header, data[:-10]))


@case("header", err.MetadataError, SHARD2, "__metadata__['format']")
def metadata_value_not_a_string(tmp: Path, k: Keys) -> Setup:
    def mutate(h: dict[str, Any]) -> None:
        h["__metadata__"] = {"format": 1}

    return _mutated2(tmp, mutate)


@case("header", err.MetadataError, SHARD2, "__metadata__")
def metadata_not_an_object(tmp: Path, k: Keys) -> Setup:
    def mutate(h: dict[str, Any]) -> None:
        h["__metadata__"] = ["format", "pt"]

    return _mutated2(tmp, mutate)


@case("header", err.AlignmentError, SHARD2, "post_attention_layernorm")
def misaligned_offset(tmp: Path, k: Keys) -> Setup:
    # a 2-byte U8 tensor first puts every F32 tensor after it off its 4-byte grid
    d = base(tmp)
    tensors = [("small", "U8", (2,)), *shard_tensors(SHARD2)]
    craft.put_shard(d, SHARD2, tensors)
    return Setup(d)


@case("header", err.TensorEntryError, SHARD2, NORM)
def entry_not_an_object(tmp: Path, k: Keys) -> Setup:
    def mutate(h: dict[str, Any]) -> None:
        h[NORM] = [1, 2]

    return _mutated2(tmp, mutate)


@case("header", err.TensorEntryError, SHARD2, "'data_offsets'")
def entry_missing_field(tmp: Path, k: Keys) -> Setup:
    def mutate(h: dict[str, Any]) -> None:
        del h[NORM]["data_offsets"]

    return _mutated2(tmp, mutate)


@case("header", err.TensorEntryError, SHARD2, "'offset'")
def entry_unknown_field(tmp: Path, k: Keys) -> Setup:
    return _mutated2(tmp, _set(NORM, "offset", 0))


# --- indexes ----------------------------------------------------------------------------


def _index(tmp: Path, change: Callable[[dict[str, Any]], Any]) -> Setup:
    d = base(tmp)
    index = craft.read_index(d)
    change(index)
    craft.write_index(d, index)
    return Setup(d)


@case("index", err.IndexSyntaxError, INDEX, "JSON")
def index_not_json(tmp: Path, k: Keys) -> Setup:
    d = base(tmp)
    craft.write_index(d, '{"weight_map": {')
    return Setup(d)


@case("index", err.IndexSyntaxError, INDEX, NORM)
def index_duplicate_weight_map_key(tmp: Path, k: Keys) -> Setup:
    d = base(tmp)
    text = json.dumps(craft.read_index(d))
    text = text.replace(f'"{NORM}": "{SHARD2}"', f'"{NORM}": "{SHARD1}", "{NORM}": "{SHARD2}"')
    craft.write_index(d, text)
    return Setup(d)


@case("index", err.IndexSchemaError, INDEX, "weight_map")
def index_without_weight_map(tmp: Path, k: Keys) -> Setup:
    return _index(tmp, lambda i: i.pop("weight_map"))


@case("index", err.IndexSchemaError, INDEX, "weight_map")
def index_weight_map_is_a_list(tmp: Path, k: Keys) -> Setup:
    return _index(tmp, lambda i: i.update(weight_map=[SHARD1]))


@case("index", err.IndexSchemaError, INDEX, f"weight_map['{NORM}']")
def index_file_name_not_a_string(tmp: Path, k: Keys) -> Setup:
    return _index(tmp, lambda i: i["weight_map"].update({NORM: 2}))


@case("index", err.IndexSchemaError, INDEX, "total_size")
def index_total_size_not_an_integer(tmp: Path, k: Keys) -> Setup:
    return _index(tmp, lambda i: i["metadata"].update(total_size="1024"))


@case("index", err.PathEscapeError, INDEX, f"weight_map['{NORM}']")
def index_absolute_file_name(tmp: Path, k: Keys) -> Setup:
    return _index(tmp, lambda i: i["weight_map"].update({NORM: "/etc/passwd.safetensors"}))


@case("index", err.PathEscapeError, INDEX, f"weight_map['{NORM}']")
def index_dotdot_file_name(tmp: Path, k: Keys) -> Setup:
    return _index(tmp, lambda i: i["weight_map"].update({NORM: "../other/x.safetensors"}))


@case("index", err.PathEscapeError, INDEX, "backslash")
def index_backslash_file_name(tmp: Path, k: Keys) -> Setup:
    return _index(tmp, lambda i: i["weight_map"].update({NORM: "..\\x.safetensors"}))


@case("index", err.PathEscapeError, INDEX, "drive prefix")
def index_drive_prefix_file_name(tmp: Path, k: Keys) -> Setup:
    return _index(tmp, lambda i: i["weight_map"].update({NORM: "C:x.safetensors"}))


@case("index", err.ShardFormatError, INDEX, "pytorch_model-00001.bin")
def index_pickle_bin_shard(tmp: Path, k: Keys) -> Setup:
    def change(i: dict[str, Any]) -> None:
        i["weight_map"][NORM] = "pytorch_model-00001.bin"

    setup = _index(tmp, change)
    # a pickle that would run code if anything unpickled it
    (setup.model / "pytorch_model-00001.bin").write_bytes(b"cos\nsystem\n(S'touch /tmp/pwned'\ntR.")
    return setup


@case("index", err.ShardFormatError, INDEX, "weights.pt")
def index_pickle_pt_shard(tmp: Path, k: Keys) -> Setup:
    return _index(tmp, lambda i: i["weight_map"].update({NORM: "weights.pt"}))


@case("index", err.MissingFileError, SHARD2, "file does not exist")
def index_missing_shard(tmp: Path, k: Keys) -> Setup:
    d = base(tmp)
    (d / SHARD2).unlink()
    return Setup(d)


@case("index", err.ShardAssignmentError, INDEX, "model.ghost.weight")
def index_tensor_absent_from_named_shard(tmp: Path, k: Keys) -> Setup:
    return _index(tmp, lambda i: i["weight_map"].update({"model.ghost.weight": SHARD1}))


@case("index", err.ShardAssignmentError, INDEX, NORM)
def index_tensor_present_in_another_shard(tmp: Path, k: Keys) -> Setup:
    return _index(tmp, lambda i: i["weight_map"].update({NORM: SHARD1}))


@case("index", err.ShardAssignmentError, INDEX, NORM)
def index_lacks_a_stored_tensor(tmp: Path, k: Keys) -> Setup:
    return _index(tmp, lambda i: i["weight_map"].pop(NORM))


@case("index", err.DuplicateTensorError, SHARD2, NORM)
def tensor_in_two_shards(tmp: Path, k: Keys) -> Setup:
    d = base(tmp)
    craft.put_shard(d, SHARD1, [*shard_tensors(SHARD1), (NORM, "F32", (4,))])
    index = craft.read_index(d)
    index["weight_map"][NORM] = SHARD1
    craft.write_index(d, index)
    return Setup(d)


@case("index", err.TotalSizeError, INDEX, "total_size")
def index_total_size_wrong(tmp: Path, k: Keys) -> Setup:
    return _index(tmp, lambda i: i["metadata"].update(total_size=i["metadata"]["total_size"] + 4))


# --- paths ------------------------------------------------------------------------------


@case("path", err.PathEscapeError, SHARD2, "outside")
def shard_symlink_leaving_root(tmp: Path, k: Keys) -> Setup:
    d = base(tmp)
    outside = tmp / "elsewhere.safetensors"
    (d / SHARD2).rename(outside)
    (d / SHARD2).symlink_to(outside)
    return Setup(d)


@case("path", err.NotRegularFileError, SHARD2, "FIFO")
def shard_is_a_fifo(tmp: Path, k: Keys) -> Setup:
    d = base(tmp)
    (d / SHARD2).unlink()
    os.mkfifo(d / SHARD2)
    return Setup(d)


@case("path", err.NotRegularFileError, SHARD2, "directory")
def shard_is_a_directory(tmp: Path, k: Keys) -> Setup:
    d = base(tmp)
    (d / SHARD2).unlink()
    (d / SHARD2).mkdir()
    return Setup(d)


@case("path", err.NotRegularFileError, SHARD2, "socket")
def shard_is_a_socket(tmp: Path, k: Keys) -> Setup:
    d = base(tmp)
    (d / SHARD2).unlink()
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(d / SHARD2))
    s.close()
    return Setup(d)


@case("path", err.PathEscapeError, SHARD2, "/dev/zero")
def shard_symlink_to_a_device(tmp: Path, k: Keys) -> Setup:
    d = base(tmp)
    (d / SHARD2).unlink()
    (d / SHARD2).symlink_to("/dev/zero")
    return Setup(d)


@case("path", err.NotRegularFileError, SHARD2, "character device")
def shard_is_a_device_node(tmp: Path, k: Keys) -> Setup:
    import stat

    d = base(tmp)
    (d / SHARD2).unlink()
    os.mknod(d / SHARD2, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # what /dev/zero is
    return Setup(d)


@case("path", err.NotRegularFileError, "config.json", "FIFO")
def config_is_a_fifo(tmp: Path, k: Keys) -> Setup:
    d = base(tmp)
    (d / "config.json").unlink()
    os.mkfifo(d / "config.json")
    return Setup(d)


@case("path", err.PathEscapeError, INDEX, "outside")
def index_symlink_leaving_root(tmp: Path, k: Keys) -> Setup:
    d = base(tmp)
    outside = tmp / "index-elsewhere.json"
    (d / INDEX).rename(outside)
    (d / INDEX).symlink_to(outside)
    return Setup(d)


# --- config -----------------------------------------------------------------------------


def _config(tmp: Path, **over: Any) -> Setup:
    d = base(tmp)
    config = dict(craft.CONFIG, **over)
    for key in [k for k, v in over.items() if v is None]:
        del config[key]
    (d / "config.json").write_text(json.dumps(config))
    return Setup(d)


@case("config", err.ConfigSyntaxError, "config.json", "JSON")
def config_not_json(tmp: Path, k: Keys) -> Setup:
    d = base(tmp)
    (d / "config.json").write_text("{'architectures': []}")
    return Setup(d)


@case("config", err.ConfigSyntaxError, "config.json", "rope_theta")
def config_nan(tmp: Path, k: Keys) -> Setup:
    d = base(tmp)
    (d / "config.json").write_text(json.dumps(craft.CONFIG)[:-1] + ', "rope_theta": NaN}')
    return Setup(d)


@case("config", err.MissingFileError, "config.json", "does not exist")
def config_missing(tmp: Path, k: Keys) -> Setup:
    d = base(tmp)
    (d / "config.json").unlink()
    return Setup(d)


@case("config", err.ConfigFieldError, "config.json", "'hidden_size'")
def config_without_hidden_size(tmp: Path, k: Keys) -> Setup:
    return _config(tmp, hidden_size=None)


@case("config", err.ConfigFieldError, "config.json", "'num_key_value_heads'")
def config_kv_heads_do_not_divide(tmp: Path, k: Keys) -> Setup:
    return _config(tmp, num_attention_heads=2, num_key_value_heads=3)


@case("config", err.MissingTensorError, "config.json", "model.layers.1.")
def config_layer_missing_from_shards(tmp: Path, k: Keys) -> Setup:
    return _config(tmp, num_hidden_layers=2)


@case("config", err.UnexpectedTensorError, SHARD2, "model.layers.0.mlp.extra.weight")
def tensor_the_config_does_not_have(tmp: Path, k: Keys) -> Setup:
    d = base(tmp)
    craft.put_shard(
        d, SHARD2, [*shard_tensors(SHARD2), ("model.layers.0.mlp.extra.weight", "F32", (4,))]
    )
    return Setup(d)


@case("config", err.TensorShapeError, SHARD2, "transpose")
def transposed_projection(tmp: Path, k: Keys) -> Setup:
    d = base(tmp)
    tensors = [(n, t, (8, 4) if n == DOWN else s) for n, t, s in shard_tensors(SHARD2)]
    craft.put_shard(d, SHARD2, tensors)
    return Setup(d)


@case("config", err.TensorDtypeError, SHARD1, "torch_dtype")
def dtype_differs_from_config(tmp: Path, k: Keys) -> Setup:
    return _config(tmp, torch_dtype="bfloat16")


@case("config", err.ConfigFieldError, "config.json", "'dtype'")
def config_dtype_unknown(tmp: Path, k: Keys) -> Setup:
    return _config(tmp, torch_dtype=None, dtype="float17")


# --- manifests and signatures -------------------------------------------------------------


def manifest_of(model: Path) -> dict[str, Any]:
    """The manifest body of a checkpoint that verifies (built with weightd's own code)."""
    from weightd.server.trust.manifest import build_body
    from weightd.server.trust.verify import VerifyOptions, verify_checkpoint

    v = verify_checkpoint(str(model), None, VerifyOptions(progress=False, file_sha256=True))
    v.store.close()
    assert v.ok and v.checkpoint is not None, [str(p) for p in v.problems]
    return build_body(v.checkpoint, v.files, v.tensor_digests)


def sign(body: dict[str, Any], key: Path) -> dict[str, Any]:
    from weightd.server.trust.signing import load_private_key, sign_body

    return sign_body(body, load_private_key(str(key)))


def _with_manifest(
    tmp: Path,
    keys: Keys,
    change: Callable[[dict[str, Any]], Any] = lambda b: None,
    *,
    signed: bool = True,
    text: str | None = None,
) -> Setup:
    d = base(tmp)
    body = manifest_of(d)
    change(body)
    doc = sign(body, keys.private) if signed else body
    path = tmp / "manifest.json"
    path.write_text(text if text is not None else json.dumps(doc))
    return Setup(d, path, [keys.public])


@case("manifest", err.ManifestSyntaxError, "manifest.json", "JSON")
def manifest_not_json(tmp: Path, k: Keys) -> Setup:
    return _with_manifest(tmp, k, text="{not json")


@case("manifest", err.ManifestSchemaError, "manifest.json", "'version'")
def manifest_unknown_version(tmp: Path, k: Keys) -> Setup:
    return _with_manifest(tmp, k, lambda b: b.update(version=2))


@case("manifest", err.ManifestSchemaError, "manifest.json", "'files'")
def manifest_without_files(tmp: Path, k: Keys) -> Setup:
    return _with_manifest(tmp, k, lambda b: b.pop("files"))


@case("manifest", err.ManifestSchemaError, "manifest.json", f"tensors['{NORM}'].digest")
def manifest_digest_malformed(tmp: Path, k: Keys) -> Setup:
    return _with_manifest(tmp, k, lambda b: b["tensors"][NORM].update(digest="md5:abc"))


@case("manifest", err.ManifestSchemaError, "manifest.json", "float")
def manifest_with_a_float(tmp: Path, k: Keys) -> Setup:
    return _with_manifest(tmp, k, lambda b: b["files"]["config.json"].update(size=1.5))


@case("manifest", err.PathEscapeError, "manifest.json", "files['../config.json']")
def manifest_file_name_escapes(tmp: Path, k: Keys) -> Setup:
    return _with_manifest(
        tmp, k, lambda b: b["files"].update({"../config.json": b["files"].pop("config.json")})
    )


@case("manifest", err.DigestMismatchError, SHARD2, "sha256")
def manifest_shard_sha256_differs(tmp: Path, k: Keys) -> Setup:
    return _with_manifest(tmp, k, lambda b: b["files"][SHARD2].update(sha256="0" * 64))


@case("manifest", err.DigestMismatchError, "config.json", "size")
def manifest_size_differs(tmp: Path, k: Keys) -> Setup:
    return _with_manifest(tmp, k, lambda b: b["files"]["config.json"].update(size=1))


@case("manifest", err.DigestMismatchError, SHARD2, NORM)
def manifest_tensor_digest_differs(tmp: Path, k: Keys) -> Setup:
    return _with_manifest(tmp, k, lambda b: b["tensors"][NORM].update(digest="blake3:" + "1" * 64))


@case("manifest", err.ManifestMismatchError, SHARD2, NORM)
def manifest_lacks_a_tensor(tmp: Path, k: Keys) -> Setup:
    return _with_manifest(tmp, k, lambda b: b["tensors"].pop(NORM))


@case("manifest", err.ManifestMismatchError, "manifest.json", "extra.safetensors")
def manifest_lists_an_extra_file(tmp: Path, k: Keys) -> Setup:
    return _with_manifest(
        tmp, k, lambda b: b["files"].update({"extra.safetensors": {"size": 8, "sha256": "a" * 64}})
    )


@case("manifest", err.ManifestMismatchError, SHARD2, DOWN)
def manifest_shape_differs(tmp: Path, k: Keys) -> Setup:
    return _with_manifest(tmp, k, lambda b: b["tensors"][DOWN].update(shape=[8, 4]))


@case("signature", err.UnsignedManifestError, "manifest.json", "'signature'")
def manifest_unsigned_but_key_required(tmp: Path, k: Keys) -> Setup:
    return _with_manifest(tmp, k, signed=False)


@case("signature", err.UntrustedKeyError, "manifest.json", "signature.key_id")
def manifest_signed_by_another_key(tmp: Path, k: Keys) -> Setup:
    d = base(tmp)
    path = tmp / "manifest.json"
    path.write_text(json.dumps(sign(manifest_of(d), k.other_private)))
    return Setup(d, path, [k.public])


@case("signature", err.BadSignatureError, "manifest.json", "signature.value")
def manifest_changed_after_signing(tmp: Path, k: Keys) -> Setup:
    d = base(tmp)
    doc = sign(manifest_of(d), k.private)
    doc["files"][SHARD2]["sha256"] = "0" * 64  # tampered after signing
    path = tmp / "manifest.json"
    path.write_text(json.dumps(doc))
    return Setup(d, path, [k.public])


@case("signature", err.BadSignatureError, "manifest.json", "signature.value")
def signature_not_base64(tmp: Path, k: Keys) -> Setup:
    d = base(tmp)
    doc = sign(manifest_of(d), k.private)
    doc["signature"]["value"] = "not base64!"
    path = tmp / "manifest.json"
    path.write_text(json.dumps(doc))
    return Setup(d, path, [k.public])


@case("signature", err.BadSignatureError, "manifest.json", "signature.algorithm")
def signature_algorithm_unknown(tmp: Path, k: Keys) -> Setup:
    d = base(tmp)
    doc = sign(manifest_of(d), k.private)
    doc["signature"]["algorithm"] = "rsa"
    path = tmp / "manifest.json"
    path.write_text(json.dumps(doc))
    return Setup(d, path, [k.public])


@case("signature", err.KeyFileError, "garbage.pub", "public key")
def trust_key_garbage(tmp: Path, k: Keys) -> Setup:
    setup = _with_manifest(tmp, k)
    bad = tmp / "garbage.pub"
    bad.write_text("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n")
    setup.trust_keys = [bad]
    return setup


@case("signature", err.KeyFileError, "x25519.pub", "not Ed25519")
def trust_key_not_ed25519(tmp: Path, k: Keys) -> Setup:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    setup = _with_manifest(tmp, k)
    pub = X25519PrivateKey.generate().public_key()
    path = tmp / "x25519.pub"
    path.write_bytes(
        pub.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    setup.trust_keys = [path]
    return setup


# --- Hugging Face cache snapshots ---------------------------------------------------------


def hf_snapshot(tmp: Path, source: Path | None = None) -> Path:
    """Lay ``source`` (default: the base checkpoint) out as a hub cache snapshot."""
    from weightd.server.checkpoint.description import git_blob_sha1

    source = source or base(tmp / "src")
    repo = tmp / "hub" / "models--org--tiny"
    snap = repo / "snapshots" / ("c0ffee" * 6 + "c0ff")
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(source.iterdir()):
        data = f.read_bytes()
        blob = (
            hashlib.sha256(data).hexdigest()
            if f.name.endswith(".safetensors")
            else git_blob_sha1(data)
        )
        (repo / "blobs" / blob).write_bytes(data)
        (snap / f.name).symlink_to(Path("../../blobs") / blob)
    return snap


@case("hfcache", err.NotASnapshotError, "model", "snapshot")
def hf_directory_not_a_snapshot(tmp: Path, k: Keys) -> Setup:
    return Setup(base(tmp), hf=True)


@case("hfcache", err.BlobLinkError, SHARD2, "regular file")
def hf_file_not_a_blob_link(tmp: Path, k: Keys) -> Setup:
    snap = hf_snapshot(tmp)
    data = (snap / SHARD2).read_bytes()
    (snap / SHARD2).unlink()
    (snap / SHARD2).write_bytes(data)
    return Setup(snap, hf=True)


@case("hfcache", err.DigestMismatchError, SHARD2, "cache blob")
def hf_blob_content_differs_from_its_name(tmp: Path, k: Keys) -> Setup:
    snap = hf_snapshot(tmp)
    blob = (snap / SHARD2).resolve()
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor
    blob.write_bytes(bytes(data))
    return Setup(snap, hf=True)


@case("hfcache", err.PathEscapeError, SHARD2, "outside")
def hf_link_into_another_repository(tmp: Path, k: Keys) -> Setup:
    snap = hf_snapshot(tmp)
    other = tmp / "hub" / "models--evil--repo" / "blobs"
    other.mkdir(parents=True)
    blob = (snap / SHARD2).resolve()
    (other / blob.name).write_bytes(blob.read_bytes())
    (snap / SHARD2).unlink()
    (snap / SHARD2).symlink_to(other / blob.name)
    return Setup(snap, hf=True)
