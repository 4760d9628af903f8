"""The per-source download cache: one directory per (endpoint, bucket, prefix), one
subdirectory per object-store version of it.

```
<cache-dir>/sources/<id>/            0700; id = SHA-256 of endpoint, bucket and prefix
  source.json                        what it is (for people; never read back)
  lock                               flock: one downloader per source per host
  v-<fp>.partial/                    a download in progress: .part-<h> files + .journal.json
  v-<fp>/                            a complete version: exactly the pinned files
```

``fp`` is a digest of every pinned object's name, size, ETag and version id, so a
version directory can only ever hold the bytes of those objects: a changed object is a
new ``fp`` (a new download), never a mixed directory. The partial directory is
renamed to ``v-<fp>`` (and the parent fsynced) only when every file is complete and
checked, so a complete-looking directory is always a complete one. A restart whose
listing gives the same ``fp`` finds ``v-<fp>`` and downloads nothing. At most the new
version and the one before it are kept (the previous one may still be serving while
its successor verifies).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Final

from ..base.atomicio import write_atomic
from ..base.errors import OutputWriteError, SourceCancelled
from ..base.redact import redact
from .download import part_name
from .journal import Journal, load_journal
from .location import S3Location
from .s3 import RemoteObject

#: Dot-named, as the part files are: no object's name can be it (an object called
#: ``journal.json`` is a file of the version like any other).
JOURNAL: Final = ".journal.json"
PARTIAL: Final = ".partial"
VERSION_PREFIX: Final = "v-"
#: Seconds between two tries of a source's lock held by another process.
_LOCK_POLL_SECONDS: Final = 0.1
#: Versions kept per source: the newest and the one it replaces.
KEEP_VERSIONS: Final = 2


def source_id(endpoint: str | None, location: S3Location) -> str:
    """The cache directory name of a source (pure)."""
    text = f"{endpoint or 'aws'}\0{location.bucket}\0{location.prefix}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def fingerprint(objects: Sequence[RemoteObject]) -> str:
    """The version name of these pinned objects (pure)."""
    lines = sorted(f"{o.name}\0{o.size}\0{o.etag}\0{o.version_id or ''}" for o in objects)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:32]


def _mkdir_private(path: str) -> None:
    """``path`` as a directory only the daemon's user can enter, made if absent.

    One that exists and is ours with a looser mode is closed (0700); one that is
    another user's is refused, never taken over: its files (what the daemon would
    serve as downloaded) are not ours to trust, and as root a ``chmod`` would be.
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise OutputWriteError(path, "not a directory (a link?); the download cache needs one")
    if st.st_uid != os.geteuid():
        raise OutputWriteError(
            path, f"owned by uid {st.st_uid}, not this user: not used as the download cache"
        )
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class SourceDir:
    """One source's cache directory, held under its lock while in use."""

    path: str

    @classmethod
    @contextlib.contextmanager
    def open(
        cls,
        root: str,
        endpoint: str | None,
        location: S3Location,
        cancel: threading.Event | None = None,
    ) -> Iterator[SourceDir]:
        _mkdir_private(root)
        path = os.path.join(root, source_id(endpoint, location))
        _mkdir_private(path)
        shown = redact(endpoint) if endpoint else endpoint  # a file anyone may cat or back up
        info = {"endpoint": shown, "bucket": location.bucket, "prefix": location.prefix}
        write_atomic(os.path.join(path, "source.json"), json.dumps(info).encode(), mode=0o600)
        with cls.locked(path, cancel) as held:
            yield held

    @classmethod
    @contextlib.contextmanager
    def locked(cls, path: str, cancel: threading.Event | None = None) -> Iterator[SourceDir]:
        """The existing source directory ``path``, under its lock. Another daemon on this
        host downloading the same source holds it: wait, unless ``cancel`` is set first
        (a reload's deadline), which ends the wait with ``SourceCancelled``."""
        fd = os.open(os.path.join(path, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if cancel is not None and cancel.is_set():
                        raise SourceCancelled(
                            path, "cancelled while another process held the source's lock"
                        ) from None
                    time.sleep(_LOCK_POLL_SECONDS)
            yield cls(path)
        finally:
            os.close(fd)

    def version(self, fp: str) -> str:
        return os.path.join(self.path, VERSION_PREFIX + fp)

    def complete(self, fp: str, objects: Sequence[RemoteObject]) -> str | None:
        """The version directory if it is there with every file at its pinned size."""
        directory = self.version(fp)
        try:
            names = set(os.listdir(directory))
            if names != {o.name for o in objects}:
                return None
            for o in objects:
                st = os.lstat(os.path.join(directory, o.name))
                if not (os.path.isfile(os.path.join(directory, o.name)) and st.st_size == o.size):
                    return None
        except OSError:
            return None
        return directory

    def partial(
        self, fp: str, objects: Sequence[RemoteObject], part_bytes: int
    ) -> tuple[str, Journal]:
        """The in-progress directory of version ``fp`` and its journal: resumed when the
        journal pins exactly these objects, else started afresh. Other versions' partial
        downloads are removed (their objects changed; none of their bytes can be used)."""
        directory = self.version(fp) + PARTIAL
        for entry in os.listdir(self.path):
            full = os.path.join(self.path, entry)
            if entry.endswith(PARTIAL) and full != directory:
                shutil.rmtree(full, ignore_errors=True)
        journal = (
            load_journal(os.path.join(directory, JOURNAL)) if os.path.isdir(directory) else None
        )
        if journal is not None and journal.matches(objects):
            # NAME exists only once its part file passed its check and was renamed (perhaps
            # just before a crash, with the journal not yet saved): complete at its size,
            # and nothing else is.
            for name, pin in journal.pins.items():
                path = os.path.join(directory, name)
                if os.path.isfile(path) and os.path.getsize(path) == pin["size"]:
                    journal.complete.add(name)
                    journal.done.pop(name, None)
                else:
                    journal.complete.discard(name)
            for name in list(journal.done):
                if not os.path.isfile(os.path.join(directory, part_name(name))):
                    journal.done.pop(name)
            return directory, journal
        shutil.rmtree(directory, ignore_errors=True)
        _mkdir_private(directory)
        return directory, Journal.start(objects, part_bytes)

    def discard(self, directory: str) -> None:
        shutil.rmtree(directory, ignore_errors=True)

    def publish(self, fp: str, directory: str, keep: Sequence[str] = ()) -> str:
        """Rename a finished partial directory to its version name; prune old versions
        except ``keep`` (directories this daemon handed out: one may be serving)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, JOURNAL))
        _fsync_dir(directory)
        final = self.version(fp)
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.rename(directory, final)
        _fsync_dir(self.path)
        self.prune({final, *keep})
        return final

    def prune(self, keep: set[str], keep_newest: int = KEEP_VERSIONS) -> None:
        """Remove complete versions other than ``keep`` beyond the newest ``keep_newest``
        (a version in ``keep`` is never removed)."""
        versions = [
            os.path.join(self.path, e)
            for e in os.listdir(self.path)
            if e.startswith(VERSION_PREFIX) and not e.endswith(PARTIAL)
        ]
        versions.sort(key=lambda p: os.stat(p).st_mtime_ns, reverse=True)
        kept = {os.path.realpath(k) for k in keep}
        for old in versions[keep_newest:]:
            if os.path.realpath(old) not in kept:
                shutil.rmtree(old, ignore_errors=True)
