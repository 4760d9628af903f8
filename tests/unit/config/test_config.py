"""The one serve config: flags, file and environment give the same config, setting by
setting; every bad value is one error naming where it was written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from weightd.server.base.errors import ConfigFileError, UsageError
from weightd.server.cli.config_commands import reference_markdown, render_json, render_toml
from weightd.server.cli.main import _parser
from weightd.server.cli.serve_options import given_flags
from weightd.server.config import Named
from weightd.server.config.fields import Setting
from weightd.server.config.kinds import (
    ByteSize,
    Choice,
    Flag,
    Integer,
    Items,
    Kind,
    Maybe,
    Parsed,
    Seconds,
    Text,
)
from weightd.server.config.load import SETTINGS, Loaded, check, load
from weightd.server.plan.declared import DeclaredLayout, LayoutGroup, parse_declared

#: Environment used for every load here: no variable of the machine leaks in.
BASE_ENV = {"HOME": "/home/u", "XDG_CACHE_HOME": "/cache"}


#: Samples for the settings whose syntax is not ``[NAME=]VALUE``, by syntax.
_PARSED_SAMPLES: dict[str, Any] = {
    "NAME|PREFIX*|*": ("alpha", "beta-*"),
    "NAME=sha256:HEX": (Named("a", "sha256:" + "0" * 64), Named("b", "sha256:" + "1" * 64)),
}


def _sample(kind: Kind[Any], default: Any) -> Any:
    """A value of ``kind`` other than ``default`` that every setting's checks accept."""
    if isinstance(kind, Maybe):
        return _sample(kind.inner, None)
    if isinstance(kind, Items):
        if isinstance(kind.inner, Parsed) and kind.inner.parse is parse_declared:
            return (
                DeclaredLayout(None, LayoutGroup(2, vocab_pad=64)),
                DeclaredLayout(None, LayoutGroup(1)),
            )
        if isinstance(kind.inner, Parsed) and kind.inner.syntax in _PARSED_SAMPLES:
            return _PARSED_SAMPLES[kind.inner.syntax]
        if isinstance(kind.inner, Parsed):
            return (Named("a", "/srv/a"), Named(None, "/srv/b"))
        return ("/srv/one", "/srv/two")
    if isinstance(kind, Choice):
        return kind.choices[-1] if default != kind.choices[-1] else kind.choices[0]
    if isinstance(kind, Flag):
        return not default
    if isinstance(kind, ByteSize):
        return 256 << 10  # within every byte setting's bounds (chunk <= 4 MiB, part >= 64 KiB)
    if isinstance(kind, Integer):
        return 7
    if isinstance(kind, Seconds):
        return 7.5
    if isinstance(kind, Text):
        return "/srv/text"
    raise AssertionError(f"no sample for {kind}")


def _text(kind: Kind[Any], value: Any) -> str:
    """``value`` as a flag or variable would spell it."""
    if isinstance(kind, Maybe):
        return _text(kind.inner, value)
    if isinstance(kind, Items):
        if any("," in str(v) for v in value):  # items that hold commas: a JSON array
            return json.dumps([str(v) for v in value])
        return ",".join(str(v) for v in value)
    if isinstance(kind, Flag):
        return "true" if value else "false"
    if isinstance(kind, ByteSize):
        return f"{value >> 10}KiB"  # the unit form, read back to the same count
    return str(value)


def _argv(s: Setting, value: Any) -> list[str]:
    kind = s.spec.kind
    if isinstance(kind, Flag):
        return [s.flag if value else "--no-" + s.flag[2:]]
    if isinstance(kind, Items):
        return [arg for v in value for arg in (s.flag, str(v))]
    return [s.flag, _text(kind, value)]


def _toml(s: Setting, value: Any) -> str:
    line = f"{s.key} = {s.spec.kind.to_toml(value)}\n"
    return f"[{s.section}]\n{line}" if s.section else line


def _from_flags(argv: list[str], env: dict[str, str] | None = None) -> Loaded:
    args = _parser().parse_args(["serve", *argv])
    return load(given_flags(args), {**BASE_ENV, **(env or {})}, args.config)


CASES = [pytest.param(s, id=s.path) for s in SETTINGS]


@pytest.mark.parametrize("setting", CASES)
def test_flag_file_and_env_give_the_same_config(setting: Setting, tmp_path: Path) -> None:
    value = _sample(setting.spec.kind, setting.default)
    assert value != setting.default
    by_flag = _from_flags(_argv(setting, value))
    by_env = load({}, {**BASE_ENV, setting.env: _text(setting.spec.kind, value)})
    path = tmp_path / "weightd.toml"
    path.write_text(_toml(setting, value))
    by_file = load({}, BASE_ENV, str(path))
    assert by_flag.config.get(setting.path) == value
    assert by_flag.config == by_env.config == by_file.config
    assert by_flag.origins[setting.path].name == _argv(setting, value)[0]
    assert by_env.origins[setting.path].name == setting.env
    assert by_file.origins[setting.path].name == f"{path}: {setting.toml_name}"
    # Everything else kept its default, whichever way the one value came.
    untouched = [s for s in SETTINGS if s is not setting and s.path not in ("listen", "cache_dir")]
    assert all(by_file.config.get(s.path) == s.default for s in untouched)


def test_precedence_default_file_env_flag(tmp_path: Path) -> None:
    path = tmp_path / "w.toml"
    path.write_text("[server]\nmax_workers = 3\nmax_concurrent_rpcs = 5\ngrace = 1\n")
    env = {"WEIGHTD_MAX_WORKERS": "4", "WEIGHTD_MAX_CONCURRENT_RPCS": "6"}
    loaded = _from_flags(["--config", str(path), "--max-workers", "9"], env)
    server = loaded.config.server
    assert (server.max_workers, server.max_concurrent_rpcs, server.grace) == (9, 6, 1.0)
    assert server.max_stream_seconds == 3600.0
    assert str(loaded.origins["server.max_workers"]) == "--max-workers"
    assert str(loaded.origins["server.max_concurrent_rpcs"]) == "WEIGHTD_MAX_CONCURRENT_RPCS"
    assert str(loaded.origins["server.grace"]) == f"{path}: [server] grace"
    assert str(loaded.origins["server.max_stream_seconds"]) == "default"


def test_config_file_from_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "w.toml"
    path.write_text('listen = "127.0.0.1:0"\n')
    loaded = load({}, {**BASE_ENV, "WEIGHTD_CONFIG": str(path)})
    assert loaded.config.listen == "127.0.0.1:0" and loaded.file == str(path)


def test_a_later_source_replaces_a_list_whole(tmp_path: Path) -> None:
    path = tmp_path / "w.toml"
    path.write_text('model = ["a=/m/a", "b=/m/b"]\n')
    loaded = _from_flags(["--config", str(path), "--model", "c=/m/c", "--model", "/m/d"])
    assert loaded.config.model == (Named("c", "/m/c"), Named(None, "/m/d"))
    env = {"WEIGHTD_MODEL": '["e=/m/e,with,commas"]'}
    assert load({}, {**BASE_ENV, **env}).config.model == (Named("e", "/m/e,with,commas"),)


def test_derived_defaults_are_concrete() -> None:
    loaded = load({}, BASE_ENV)
    assert loaded.config.cache_dir == "/cache/weightd"
    assert loaded.config.listen.startswith("unix:///") and loaded.config.listen.endswith(".sock")
    assert load({}, {"HOME": "/home/u"}).config.cache_dir.endswith("/.cache/weightd")


FILE_ERRORS = [
    ("max_workers = 3\n", "max_workers: unknown key here (did you mean [server] max_workers?)"),
    ("[server]\nmax_worker = 3\n", "[server] max_worker: unknown key (did you mean max_workers?)"),
    ("[sever]\nmax_workers = 3\n", "sever: unknown key (did you mean server?)"),
    ("server = 3\n", "server: expected a [server] table"),
    ('[server]\nmax_workers = "3"\n', '[server] max_workers: expected an integer, got "3"'),
    ("[server]\nmax_workers = true\n", "[server] max_workers: expected an integer, got True"),
    ("[server]\nmax_workers = 0\n", "[server] max_workers = 0: must be at least 1"),
    ("[server]\ngrace = nan\n", "[server] grace: expected a finite number of seconds"),
    ("[server]\ngrace = -1\n", "[server] grace = -1.0: must be 0 or more"),
    ('[server]\nchunk_bytes = "5MiB"\n', "[server] chunk_bytes = 5242880: must be at most"),
    ('[server]\nchunk_bytes = "1 parsec"\n', "[server] chunk_bytes: expected a byte count"),
    ('model = "/m"\n', "model: expected an array of [NAME=]DIR or [NAME=]s3://BUCKET/PREFIX/"),
    ("model = [1]\n", "model: expected [NAME=]DIR"),
    ('log_level = "LOUD"\n', "log_level: expected one of DEBUG, INFO, WARNING, ERROR"),
    ("insecure = 1\n", "insecure: expected true or false, got 1"),
    ("listen = \n", "not valid TOML"),
    ('model = ["a="]\n', "nothing after a="),
]


@pytest.mark.parametrize(("text", "message"), FILE_ERRORS)
def test_file_errors_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "w.toml"
    path.write_text(text)
    with pytest.raises(ConfigFileError) as info:
        load({}, BASE_ENV, str(path))
    assert str(info.value).startswith(f"{path}: ")
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_file_that_is_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError, match="not a regular file"):
        load({}, BASE_ENV, str(tmp_path))
    with pytest.raises(ConfigFileError, match="config file: cannot read: No such file"):
        load({}, BASE_ENV, str(tmp_path / "missing.toml"))
    big = tmp_path / "big.toml"
    big.write_text("# " + "x" * (1 << 20) + "\n")
    with pytest.raises(ConfigFileError, match="larger than"):
        load({}, BASE_ENV, str(big))
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"listen = '\xff'\n")
    with pytest.raises(ConfigFileError, match="not UTF-8"):
        load({}, BASE_ENV, str(binary))


ENV_AND_FLAG_ERRORS = [
    ("WEIGHTD_MAX_WORKERS", "x", "--max-workers", "expected an integer"),
    ("WEIGHTD_MAX_WORKERS", "0", "--max-workers", "must be at least 1"),
    ("WEIGHTD_INSECURE", "maybe", None, "expected true/false"),
    ("WEIGHTD_S3_PART_BYTES", "1KiB", "--s3-part-bytes", "must be at least 65536"),
    ("WEIGHTD_GRACE", "inf", "--grace", "expected a finite number of seconds"),
    ("WEIGHTD_LOG_LEVEL", "LOUD", "--log-level", "expected one of"),
    ("WEIGHTD_MODEL", "[1]", None, "expected a JSON array of strings"),
    ("WEIGHTD_MODEL", "[" * 100_000, None, "expected a JSON array of strings"),  # too deep
]


@pytest.mark.parametrize(("var", "text", "flag", "message"), ENV_AND_FLAG_ERRORS)
def test_env_and_flag_errors_name_their_source(
    var: str, text: str, flag: str | None, message: str
) -> None:
    with pytest.raises(UsageError) as info:
        load({}, {**BASE_ENV, var: text})
    assert str(info.value).startswith(f"{var}=") and message in str(info.value)
    if flag is not None:
        with pytest.raises(UsageError) as info:
            _from_flags([flag, text])
        assert str(info.value).startswith(f"{flag} ") and message in str(info.value)


def test_empty_and_foreign_variables_are_not_settings() -> None:
    loaded = load({}, {**BASE_ENV, "WEIGHTD_MAX_WORKERS": "", "WEIGHTD_PYTHON": "/usr/bin/py"})
    assert loaded.config.server.max_workers == 16
    assert str(loaded.origins["server.max_workers"]) == "default"


CROSS = [
    (["--trust-key", "/k.pub"], ["a"], "--trust-key: needs a manifest"),
    (["--manifest", "/m.json"], ["a", "b"], "name the model (NAME=FILE)"),
    (["--manifest", "c=/m.json"], ["a"], "no model named 'c'"),
    (["--manifest", "a=/m", "--manifest", "a=/n"], ["a"], "two manifests for a"),
    ([], ["a", "a"], "two models named 'a'"),
    (["--tls-key", "/k.pem"], ["a"], "--tls-key: needs tls-cert"),
]


@pytest.mark.parametrize(("argv", "names", "message"), CROSS)
def test_rules_across_settings(argv: list[str], names: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check(_from_flags(argv), names)


def test_cross_setting_error_names_the_file_key(tmp_path: Path) -> None:
    path = tmp_path / "w.toml"
    path.write_text('[trust]\ntrust_key = ["/k.pub"]\n')
    with pytest.raises(UsageError, match=r"w\.toml: \[trust\] trust_key: needs a manifest"):
        check(_from_flags(["--config", str(path)]), ["a"])


def test_show_is_a_config_file_that_loads_back(tmp_path: Path) -> None:
    argv = ["--model", "a=/m/a", "--max-workers", "3", "--no-shm", "--s3-part-bytes", "1MiB"]
    env = {"WEIGHTD_S3_ENDPOINT": "http://127.0.0.1:1", "WEIGHTD_ADMIN_ALLOW": "x,y"}
    loaded = _from_flags(argv, env)
    shown = render_toml(loaded)
    assert "max_workers = 3  # --max-workers" in shown
    assert 'endpoint = "http://127.0.0.1:1"  # WEIGHTD_S3_ENDPOINT' in shown
    assert "# cert = (unset)  # default" in shown
    path = tmp_path / "shown.toml"
    path.write_text(shown)
    assert load({}, BASE_ENV, str(path)).config == loaded.config
    doc = json.loads(render_json(loaded))
    assert doc["settings"]["local.shm"] == {"value": False, "origin": "--no-shm"}
    assert doc["settings"]["adapters.root"] == {"value": [], "origin": "default"}


def test_every_setting_is_documented_in_the_reference() -> None:
    page = reference_markdown()
    for s in SETTINGS:
        assert f"`{s.flag}`" in page and f"`{s.env}`" in page
        assert len(s.spec.help) > 10, f"{s.path}: help too short to help"
    assert len({s.flag for s in SETTINGS}) == len(SETTINGS) == len({s.env for s in SETTINGS})


def test_help_shows_defaults_and_variables(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "[default: 16; WEIGHTD_MAX_WORKERS]" in out
    assert "[default: off; WEIGHTD_INSECURE]" in out


def test_deploy_config_file_loads() -> None:
    """The file deploy/ ships is a valid config (an unknown key would stop the unit)."""
    root = Path(__file__).resolve().parents[3]
    path = root / "deploy" / "weightd.toml"
    loaded = load({}, BASE_ENV, str(path))
    assert loaded.file == str(path)
    assert any(str(o).startswith(str(path)) for o in loaded.origins.values())
