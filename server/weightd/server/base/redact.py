"""Secrets out of text that is shown: a URL's password, a signed URL's signature.

Configuration is shown (``weightd config show``, start-up logs, error details) and a
value may carry a credential the operator put there: an S3 endpoint written
``https://user:password@host``, a presigned URL's ``X-Amz-Signature``, a
``?token=``. :func:`redact` replaces each with ``***`` wherever it sits in the text
(pure), so every place that shows configuration calls it on what it shows, whatever
the setting: a new setting that holds a URL is covered without being listed.
"""

from __future__ import annotations

import re
from typing import Final

MASK: Final = "***"

#: ``scheme://userinfo@``: everything between ``//`` and the last ``@`` before the host.
_USERINFO: Final = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)([^/?#\s@\"']*)@")
#: A query or fragment parameter whose name says it is a credential.
_PARAM: Final = re.compile(
    r"(?i)([?&#;](?:[a-z0-9_.-]*(?:signature|token|secret|password|passwd|credential|"
    r"api[_-]?key|access[_-]?key|session)[a-z0-9_.-]*)=)([^&#\s\"']*)"
)


def redact(text: str) -> str:
    """``text`` with URL passwords and credential parameters replaced by ``***`` (pure).

    The whole user part goes, a name without a password too: a token is often written
    there (``https://TOKEN@host``).
    """
    masked = _USERINFO.sub(lambda m: f"{m.group(1)}{MASK}@", text)
    return _PARAM.sub(lambda m: m.group(1) + MASK, masked)
