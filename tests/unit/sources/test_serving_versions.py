"""Which cached versions may go: only those that no model or adapter serves (issue 37,
case 5), whatever path names the cache (a cache directory reached through a link is
the same directory)."""

from __future__ import annotations

import os
from pathlib import Path

from weightd.server.sources.cache import SourceDir
from weightd.server.sources.location import S3Location
from weightd.server.sources.resolver import SourceOptions, SourceResolver


def test_the_serving_version_is_never_pruned_nor_rejected(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    root = str(tmp_path / "link" / "sources")
    resolver = SourceResolver(SourceOptions(cache_dir=root))
    with SourceDir.open(root, None, S3Location("models", "m/")) as cache:
        versions = []
        for i, name in enumerate(("v-a", "v-b", "v-c", "v-d")):
            path = Path(cache.path) / name
            path.mkdir()
            os.utime(path, ns=(i * 10**9, i * 10**9))
            versions.append(str(path))
    a, d = versions[0], versions[3]
    # Accepted through its real path; pruned through the link's.
    resolver.accept("llama", os.path.realpath(a))
    with SourceDir.open(root, None, S3Location("models", "m/")) as cache:
        cache.prune(resolver._keep(cache.path), keep_newest=1)
    assert [os.path.exists(v) for v in versions] == [True, False, False, True]
    resolver.reject(a)  # it serves: kept
    resolver.reject(d)  # it does not: removed (it failed verification)
    assert os.path.exists(a) and not os.path.exists(d)
    resolver.reject(str(tmp_path / "elsewhere"))  # not the cache's: never touched
    resolver.accept("llama", str(tmp_path / "real" / "local-model"))  # a local model: ignored
    assert resolver._keep(os.path.dirname(a)) == {os.path.realpath(a)}
