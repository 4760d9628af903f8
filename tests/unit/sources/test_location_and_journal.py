"""Pure rules of remote sources: s3:// locations, object names, range plans, journals,
version fingerprints and the failure-reason table."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from weightd.server.base import errors
from weightd.server.sources.cache import fingerprint, source_id
from weightd.server.sources.journal import Journal, parse_journal, plan_ranges
from weightd.server.sources.location import (
    S3Location,
    adapter_location,
    default_model_name,
    object_file_name,
    parse_s3_uri,
)
from weightd.server.sources.s3 import RemoteObject
from weightd.server.telemetry.metrics import SOURCE_FAILURE_REASONS, source_failure_reason


@pytest.mark.parametrize(
    ("text", "bucket", "prefix"),
    [
        ("s3://models/llama", "models", "llama/"),
        ("s3://models/llama/", "models", "llama/"),
        ("s3://models/org/llama-3/", "models", "org/llama-3/"),
        ("s3://my.bucket-1", "my.bucket-1", ""),
    ],
)
def test_locations_parse(text: str, bucket: str, prefix: str) -> None:
    assert parse_s3_uri(text) == S3Location(bucket, prefix)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("http://models/llama/", "is not an s3:// location"),
        ("s3:///llama/", "bucket name ''"),
        ("s3://UPPER/llama/", "bucket name 'UPPER'"),
        ("s3://models/a/../b/", "'..' segment"),
        ("s3://models/a//b/", "empty"),
        ("s3://models/a\x00b/", "control characters"),
        ("s3://models/" + "k" * 1100, "key limit"),
    ],
)
def test_bad_locations_are_refused_naming_them(text: str, needle: str) -> None:
    with pytest.raises(errors.UsageError, match=needle.replace(".", r"\.")):
        parse_s3_uri(text)


def test_only_plain_names_directly_under_the_prefix_become_files() -> None:
    loc = S3Location("models", "llama/")
    assert object_file_name(loc, "llama/config.json") == "config.json"
    for key in ("llama/sub/x.json", "other/config.json", "llama/", "llama/.hidden",
                "llama/..", "llama/a\\b", "llama/a\nb", "llama/" + "n" * 300):  # fmt: skip
        assert object_file_name(loc, key) is None, key


def test_adapters_must_lie_strictly_under_an_s3_root() -> None:
    roots = (S3Location("models", "adapters/"),)
    assert adapter_location("s3://models/adapters/a", roots) == S3Location("models", "adapters/a/")
    for bad in ("s3://models/adapters/", "s3://models/adapters-x/a/", "s3://other/adapters/a/"):
        with pytest.raises(errors.InvalidRequest, match="not under an adapter root"):
            adapter_location(bad, roots)
    with pytest.raises(errors.InvalidRequest, match="no s3:// adapter roots"):
        adapter_location("s3://models/adapters/a/", ())


def test_default_names() -> None:
    assert default_model_name("s3://models/org/llama-3/") == "llama-3"
    assert default_model_name("s3://models") == "models"


def test_range_plans_cover_every_byte_once() -> None:
    assert plan_ranges(0, 4) == []
    assert plan_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert plan_ranges(8, 4) == [(0, 4), (4, 8)]
    with pytest.raises(ValueError):
        plan_ranges(8, 0)


def _obj(name: str, size: int, etag: str = '"e"') -> RemoteObject:
    return RemoteObject(name, "p/" + name, size, etag)


def test_journal_round_trip_and_missing_ranges() -> None:
    a, b = _obj("a.safetensors", 10), _obj("config.json", 3)
    j = Journal.start([a, b], 4)
    j.done["a.safetensors"] = {(0, 4), (8, 10)}
    j.complete.add("config.json")
    back = parse_journal(j.to_json())
    assert back is not None and back == j
    assert back.missing(a) == [(4, 8)] and back.missing(b) == []
    assert back.done_bytes() == 6 + 3
    assert back.matches([a, b]) and not back.matches([a, _obj("config.json", 3, '"f"')])


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"[]",
        b'{"format": "other"}',
        b'{"format": "weightd-download-journal", "version": 2}',
        b'{"format": "weightd-download-journal", "version": 1, "part_bytes": 0, "pins": {},'
        b' "done": {}, "complete": []}',
        b'{"format": "weightd-download-journal", "version": 1, "part_bytes": 4, "pins": {},'
        b' "done": {"x": [[0, 4]]}, "complete": []}',
        b'{"format": "weightd-download-journal", "version": 1, "part_bytes": 4, "pins": {},'
        b' "done": {}, "complete": ["x"]}',
        b"[" * 100_000,  # nested too deep
    ],
)
def test_unusable_journals_are_discarded(raw: bytes) -> None:
    assert parse_journal(raw) is None


def test_fingerprints_pin_every_object_field() -> None:
    base = [_obj("a", 1), _obj("b", 2)]
    fp = fingerprint(base)
    assert fingerprint(list(reversed(base))) == fp
    assert fingerprint([_obj("a", 1, '"x"'), _obj("b", 2)]) != fp
    assert fingerprint([_obj("a", 9), _obj("b", 2)]) != fp
    assert fingerprint([RemoteObject("a", "p/a", 1, '"e"', "v2"), _obj("b", 2)]) != fp
    assert source_id("http://a", S3Location("m", "x/")) != source_id(None, S3Location("m", "x/"))


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (errors.ObjectNotFound("s3://m/x", "gone"), "not_found"),
        (errors.ObjectAccessDenied("s3://m/x", "no"), "access_denied"),
        (errors.ObjectStoreUnreachable("s3://m/x", "down"), "unreachable"),
        (errors.ObjectStoreTooSlow("s3://m/x", "drip"), "too_slow"),
        (errors.ObjectStoreProtocolError("s3://m/", "no Key"), "protocol"),
        (errors.SourceCancelled("s3://m/", "deadline"), "cancelled"),
        (errors.ObjectStoreThrottled("s3://m/x", "slow"), "throttled"),
        (errors.ObjectChanged("s3://m/x", "changed"), "changed"),
        (errors.ObjectTruncated("s3://m/x", "short"), "short_object"),
        (errors.DigestMismatchError("s3://m/x", "sha"), "digest_mismatch"),
        (errors.ManifestMismatchError("s3://m/", "size"), "manifest"),
        (errors.RemoteTrustError("no manifest"), "untrusted"),
        (errors.StorageFullError("/c", "full"), "cache_write"),
        (OSError("disk"), "io"),
        (RuntimeError("bug"), "internal"),
    ],
)
def test_failure_reasons(error: BaseException, reason: str) -> None:
    assert source_failure_reason(error) == reason
    assert reason in SOURCE_FAILURE_REASONS


def test_store_errors_carry_codes_that_say_who_can_fix_them() -> None:
    assert errors.ObjectStoreUnreachable("u", "p").code is errors.Code.UNAVAILABLE
    assert errors.ObjectNotFound("u", "p").code is errors.Code.FAILED_PRECONDITION
    assert errors.ObjectAccessDenied("u", "p").code is errors.Code.FAILED_PRECONDITION
    assert errors.ObjectChanged("u", "p").code is errors.Code.ABORTED
    assert errors.ObjectTruncated("u", "p").code is errors.Code.DATA_LOSS
    assert str(errors.ObjectChanged("s3://m/x", "p")) == "s3://m/x: p"


def test_prune_keeps_the_newest_versions_and_every_one_handed_out(tmp_path: Path) -> None:
    import os

    from weightd.server.sources.cache import SourceDir

    for i, name in enumerate(["v-a", "v-b", "v-c", "v-d", "v-e.partial"]):
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, ns=(i * 10**9, i * 10**9))
    SourceDir(str(tmp_path)).prune({str(tmp_path / "v-a")})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v-a", "v-c", "v-d", "v-e.partial"]


def test_too_large_objects_have_their_own_reason() -> None:
    assert source_failure_reason(errors.ObjectTooLarge("s3://m/x.json", "big")) == "too_large"
    assert errors.ObjectTooLarge("u", "p").code is errors.Code.FAILED_PRECONDITION


def test_progress_draws_a_bar_with_rate_and_eta_on_a_terminal() -> None:
    import io

    from weightd.server.sources.resolver import _Progress

    p = _Progress("llama", "s3://m/llama/", already=0)
    p.stream, p.tty = io.StringIO(), True
    p.start -= 2.0  # two seconds in
    p(1 << 30, 4 << 30)
    p(4 << 30, 4 << 30)
    out = p.stream.getvalue()
    assert out.startswith("\rdownload llama [") and " 25.0% " in out and "ETA " in out
    assert out.endswith("\n") and "100.0%" in out


def test_a_resumed_partial_download_keeps_only_what_is_on_disk(tmp_path: Path) -> None:
    from weightd.server.sources.cache import JOURNAL, SourceDir
    from weightd.server.sources.download import part_name

    objs = [_obj("a", 4), _obj("b", 8), _obj("c", 8)]
    cache = SourceDir(str(tmp_path))
    directory, journal = cache.partial("fp", objs, 4)
    assert journal.done == {} and not journal.complete
    journal.done = {"a": {(0, 4)}, "b": {(0, 4)}, "c": {(4, 8)}}
    journal.save(str(Path(directory) / JOURNAL))
    (Path(directory) / "a").write_bytes(b"aaaa")  # checked and renamed, journal not saved
    (Path(directory) / part_name("b")).write_bytes(b"\0" * 8)  # c's part file is gone
    (tmp_path / "v-old.partial").mkdir()  # another version's download: removed
    again, resumed = SourceDir(str(tmp_path)).partial("fp", objs, 16)
    assert again == directory and resumed.complete == {"a"}
    assert resumed.done == {"b": {(0, 4)}} and resumed.part_bytes == 4
    assert resumed.missing(objs[1]) == [(4, 8)] and resumed.missing(objs[2]) == [(0, 4), (4, 8)]
    assert not (tmp_path / "v-old.partial").exists()
    changed = [_obj("a", 4, '"new"'), *objs[1:]]
    _, fresh = SourceDir(str(tmp_path)).partial("fp", changed, 4)
    assert fresh.done == {} and not fresh.complete  # other pins: nothing kept


def test_a_span_is_covered_only_when_every_range_touching_it_is_done() -> None:
    from weightd.server.sources.tensorcheck import covered

    assert covered(0, 8, 4, {0, 4}) and covered(5, 5, 4, set())
    assert not covered(0, 8, 4, {0})
    assert covered(3, 5, 4, {0, 4}) and not covered(3, 5, 4, {4})
    assert covered(8, 9, 4, {8}) and not covered(7, 9, 4, {8})


def test_a_download_cache_directory_of_another_user_is_refused_not_taken_over(
    tmp_path: Path,
) -> None:
    """Its files would be served as downloaded: another user's directory is never
    chmodded and used (root could), and a link in its place is refused."""
    from weightd.server.base.errors import OutputWriteError
    from weightd.server.sources.cache import SourceDir

    location = parse_s3_uri("s3://bucket/model/")
    root = tmp_path / "sources"
    root.mkdir(mode=0o755)
    if os.geteuid() == 0:
        os.chown(root, 65534, 65534)
        with (
            pytest.raises(OutputWriteError, match="owned by uid 65534"),
            SourceDir.open(str(root), None, location),
        ):
            pass
        assert oct(root.stat().st_mode & 0o777) == "0o755"  # untouched
        root.rmdir()
    root.symlink_to(tmp_path)
    with (
        pytest.raises(OutputWriteError, match="not a directory"),
        SourceDir.open(str(root), None, location),
    ):
        pass
