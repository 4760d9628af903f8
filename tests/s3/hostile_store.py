"""A small S3-compatible server on loopback that misbehaves on purpose, for the tests.

Run out of process by the ``hostile`` fixture (``python -m tests.s3.hostile_store ROOT
PORT_FILE``). Objects are plain files: ``ROOT/<bucket>/<key>``. It answers the three
calls a download makes (ListObjectsV2, HeadObject, ranged GetObject) the way S3 does,
signatures unchecked, unless the bucket's control file ``ROOT/<bucket>.json`` names
scenarios; the file is read again on every request, so a test can turn a scenario on
or off while a daemon runs. Each scenario applies to every key, or to the keys ending
with one of its ``"keys"`` suffixes:

``{"endless_body": {}}``            GET bodies that never end (chunked, no length)
``{"drip": {"every": 2.0}}``        GET bodies one byte every ``every`` seconds
``{"drip_headers": {"every": 2.0}}`` the status line and headers one byte at a time
``{"empty_pages": {}}``             every listing page empty, truncated, a new token
``{"same_token": {}}``              every listing page truncated with the same token
``{"huge_page": {"keys": 400000}}``  one listing page of that many made-up keys
``{"slow_list": {"every": 1.0}}``   listing pages dripped a byte at a time
``{"missing_key": {}}``             a listing entry without ``Key``
``{"duplicate_key": {}}``           the last listing entry listed twice
``{"bad_size": {"value": "12x"}}``  listing ``Size`` (and HEAD length) set to ``value``
``{"wrong_size": {"delta": 5}}``    listing and HEAD sizes off by ``delta``
``{"bad_range": {"value": "bytes 0-9/abc"}}`` that ``Content-Range`` on every GET
``{"multipart_etag": {}}``          ETags of the form ``"<md5>-2"`` (no MD5 to check)
``{"ignore_if_match": {}}``         ``If-Match`` ignored
``{"drop_headers": {}}``            GET answers without ``ETag`` and ``Content-Range``
``{"mix": {"other": "k2"}}``        GETs past the first answered from the object ``other``
``{"error": {"status": 500, "code": "...", "message_bytes": 4194304}}``
                                    every request answered with that error document
``{"flaky": {"failures": 1}}``      the bucket's first requests answered 503 SlowDown
``{"count_only": {}}``              nothing odd: requests are counted, as always

``GET /_hostile/stats?bucket=B`` returns the requests seen per kind (list, head, get)
and the body bytes sent, for assertions on how much work a client made.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import threading
import time
import urllib.parse
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

#: Where the objects live (``main`` sets it from the command line).
PLACE: dict[str, Path] = {"root": Path(".")}
STATS: dict[str, Counter[str]] = {}
STATS_LOCK = threading.Lock()


def _count(bucket: str, kind: str, n: int = 1) -> None:
    with STATS_LOCK:
        STATS.setdefault(bucket, Counter())[kind] += n


def _scenarios(bucket: str, key: str | None) -> dict[str, dict[str, Any]]:
    try:
        raw = json.loads((PLACE["root"] / f"{bucket}.json").read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for name, cfg in raw.items():
        suffixes = cfg.get("keys_ending")
        if key is not None and suffixes and not any(key.endswith(s) for s in suffixes):
            continue
        out[name] = cfg
    return out


def _etag(data: bytes, multipart: bool) -> str:
    digest = hashlib.md5(data, usedforsecurity=False).hexdigest()
    return f'"{digest}-2"' if multipart else f'"{digest}"'


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def handle(self) -> None:
        with contextlib.suppress(OSError):  # the client closed it: what the tests make it do
            super().handle()

    # --- plumbing ---------------------------------------------------------------------

    def _split(self) -> tuple[str, str, dict[str, str]]:
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
        path = urllib.parse.unquote(url.path).lstrip("/")
        bucket, _, key = path.partition("/")
        return bucket, key, query

    def _send_head(self, status: int, headers: dict[str, str], drip: float = 0.0) -> None:
        if drip:
            lines = [f"HTTP/1.1 {status} X\r\n"]
            lines += [f"{k}: {v}\r\n" for k, v in headers.items()]
            lines.append("\r\n")
            for byte in "".join(lines).encode():
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(drip)
            return
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()

    def _xml(self, status: int, body: bytes, drip: float = 0.0) -> None:
        self._send_head(
            status, {"Content-Type": "application/xml", "Content-Length": str(len(body))}
        )
        if drip:
            for byte in body:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(drip)
        elif self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, bucket: str, cfg: dict[str, Any]) -> None:
        status = int(cfg.get("status", 500))
        code = escape(str(cfg.get("code", "InternalError")))
        message = "m" * int(cfg.get("message_bytes", 16))
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>{message}</Message><RequestId>1</RequestId></Error>"
        ).encode()
        self._xml(status, body)

    def _flaky(self, bucket: str, cfg: dict[str, Any]) -> bool:
        """Answer 503 SlowDown to the first ``failures`` requests of the bucket."""
        with STATS_LOCK:
            seen = STATS.setdefault(bucket, Counter())["flaky"]
            if seen >= int(cfg.get("failures", 1)):
                return False
            STATS[bucket]["flaky"] += 1
        self._error(bucket, {"status": 503, "code": "SlowDown"})
        return True

    def _file(self, bucket: str, key: str) -> Path | None:
        p = PLACE["root"] / bucket / key
        if not key or ".." in key.split("/") or not p.is_file():
            return None
        return p

    # --- requests ---------------------------------------------------------------------

    def do_GET(self) -> None:
        bucket, key, query = self._split()
        if bucket == "_hostile":
            stats = dict(STATS.get(query.get("bucket", ""), Counter()))
            self._xml(200, json.dumps(stats).encode())
            return
        scen = _scenarios(bucket, key or None)
        if "error" in scen:
            _count(bucket, "error")
            self._error(bucket, scen["error"])
            return
        if "flaky" in scen and self._flaky(bucket, scen["flaky"]):
            return
        if not key:
            self._list(bucket, query, scen)
            return
        self._get(bucket, key, scen)

    def do_HEAD(self) -> None:
        bucket, key, _ = self._split()
        scen = _scenarios(bucket, key)
        _count(bucket, "head")
        if "error" in scen:
            self._error(bucket, scen["error"])
            return
        p = self._file(bucket, key)
        if p is None:
            self._send_head(404, {"Content-Length": "0"})
            return
        data = p.read_bytes()
        size: Any = len(data)
        if "bad_size" in scen:
            size = scen["bad_size"].get("value", "12x")
        if "wrong_size" in scen:
            size = len(data) + int(scen["wrong_size"].get("delta", 5))
        self._send_head(
            200,
            {
                "Content-Length": str(size),
                "ETag": _etag(data, "multipart_etag" in scen),
                "Last-Modified": "Mon, 01 Jan 2024 00:00:00 GMT",
            },
        )

    def _list(self, bucket: str, query: dict[str, str], scen: dict[str, dict[str, Any]]) -> None:
        _count(bucket, "list")
        drip = float(scen.get("slow_list", {}).get("every", 0.0))
        prefix = query.get("prefix", "")
        token = query.get("continuation-token", "")
        if "empty_pages" in scen or "same_token" in scen:
            nxt = "same" if "same_token" in scen else f"t{int(token[1:] or 0) + 1 if token else 1}"
            body = (
                '<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult>'
                f"<Name>{bucket}</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>0</KeyCount>"
                f"<MaxKeys>1000</MaxKeys><IsTruncated>true</IsTruncated>"
                f"<NextContinuationToken>{nxt}</NextContinuationToken></ListBucketResult>"
            ).encode()
            self._xml(200, body, drip)
            return
        if "huge_page" in scen:
            self._huge_page(bucket, prefix, int(scen["huge_page"].get("keys", 400_000)))
            return
        base = PLACE["root"] / bucket
        keys = sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file())
        keys = [k for k in keys if k.startswith(prefix)]
        delimiter = query.get("delimiter", "")
        contents, prefixes = [], set()
        for k in keys:
            rest = k[len(prefix) :]
            if delimiter and delimiter in rest:
                prefixes.add(prefix + rest.split(delimiter)[0] + delimiter)
            else:
                contents.append(k)
        items = []
        for n, k in enumerate(contents):
            data = (base / k).read_bytes()
            s = _scenarios(bucket, k)
            size: Any = len(data)
            if "bad_size" in s:
                size = s["bad_size"].get("value", "12x")
            if "wrong_size" in s:
                size = len(data) + int(s["wrong_size"].get("delta", 5))
            etag = escape(_etag(data, "multipart_etag" in s))
            key_xml = "" if ("missing_key" in s and n == 0) else f"<Key>{escape(k)}</Key>"
            items.append(
                f"<Contents>{key_xml}<LastModified>2024-01-01T00:00:00.000Z</LastModified>"
                f"<ETag>{etag}</ETag><Size>{size}</Size><StorageClass>STANDARD</StorageClass>"
                "</Contents>"
            )
        if items and "duplicate_key" in scen:
            items.append(items[-1])
        items += [
            f"<CommonPrefixes><Prefix>{escape(p)}</Prefix></CommonPrefixes>"
            for p in sorted(prefixes)
        ]
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult>'
            f"<Name>{bucket}</Name><Prefix>{escape(prefix)}</Prefix>"
            f"<KeyCount>{len(items)}</KeyCount><MaxKeys>1000</MaxKeys>"
            f"<Delimiter>{escape(delimiter)}</Delimiter><IsTruncated>false</IsTruncated>"
            + "".join(items)
            + "</ListBucketResult>"
        ).encode()
        self._xml(200, body, drip)

    def _huge_page(self, bucket: str, prefix: str, n: int) -> None:
        """One page of ``n`` keys, written as it is made (the server's memory stays small)."""
        self._send_head(200, {"Content-Type": "application/xml", "Transfer-Encoding": "chunked"})
        head = (
            '<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult>'
            f"<Name>{bucket}</Name><Prefix>{escape(prefix)}</Prefix><MaxKeys>1000</MaxKeys>"
            "<IsTruncated>false</IsTruncated>"
        )
        try:
            self._chunk(head.encode())
            batch = []
            for i in range(n):
                batch.append(
                    f"<Contents><Key>{escape(prefix)}f{i:08d}.json</Key><ETag>&quot;"
                    f"{i:032x}&quot;</ETag><Size>2</Size></Contents>"
                )
                if len(batch) == 1000:
                    self._chunk("".join(batch).encode())
                    _count(bucket, "bytes", sum(len(b) for b in batch))
                    batch = []
            self._chunk(("".join(batch) + "</ListBucketResult>").encode())
            self._chunk(b"")
        except OSError:
            return

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def _get(self, bucket: str, key: str, scen: dict[str, dict[str, Any]]) -> None:
        _count(bucket, "get")
        p = self._file(bucket, key)
        if p is None:
            body = b"<Error><Code>NoSuchKey</Code><Message>no</Message></Error>"
            self._xml(404, body)
            return
        data = p.read_bytes()
        etag = _etag(data, "multipart_etag" in scen)
        if "mix" in scen:
            with STATS_LOCK:
                seen = STATS.setdefault(bucket, Counter())["mix_gets"]
                STATS[bucket]["mix_gets"] += 1
            if seen:
                other = self._file(bucket, scen["mix"]["other"])
                if other is not None:
                    data = other.read_bytes()
        wanted = self.headers.get("If-Match")
        if wanted and wanted != etag and "ignore_if_match" not in scen:
            self._xml(412, b"<Error><Code>PreconditionFailed</Code><Message>x</Message></Error>")
            return
        start, end = 0, len(data)
        rng = self.headers.get("Range", "")
        status = 200
        if rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            start, end = int(a), min(int(b) + 1, len(data))
            status = 206
        headers = {"Last-Modified": "Mon, 01 Jan 2024 00:00:00 GMT"}
        if "drop_headers" not in scen:
            headers["ETag"] = etag
            if status == 206:
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        if "bad_range" in scen:
            headers["Content-Range"] = str(scen["bad_range"].get("value", "bytes 0-9/abc"))
        drip_headers = float(scen.get("drip_headers", {}).get("every", 0.0))
        try:
            if "endless_body" in scen:
                headers["Transfer-Encoding"] = "chunked"
                self._send_head(status, headers, drip_headers)
                block = b"\0" * (1 << 16)
                while True:
                    self._chunk(block)
                    _count(bucket, "bytes", len(block))
            headers["Content-Length"] = str(end - start)
            self._send_head(status, headers, drip_headers)
            every = float(scen.get("drip", {}).get("every", 0.0))
            if every:
                for byte in data[start:end]:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    _count(bucket, "bytes")
                    time.sleep(every)
                return
            self.wfile.write(data[start:end])
            _count(bucket, "bytes", end - start)
        except OSError:
            return


def main() -> None:
    PLACE["root"] = Path(sys.argv[1])
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    tmp = sys.argv[2] + ".tmp"
    Path(tmp).write_text(str(server.server_address[1]))
    os.rename(tmp, sys.argv[2])
    server.serve_forever()


if __name__ == "__main__":
    main()
