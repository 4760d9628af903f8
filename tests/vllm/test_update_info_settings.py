"""An update's and the engine's info are read by weightd.vllm's one settings rule.

``WeightdUpdateInfo`` / ``WeightdInitInfo`` subclass vLLM's own classes, so they are
built under ``.venv-vllm`` (one short process, no engine): each bad value is a
``SettingsError`` (a ``ValueError``, which vLLM reports for a bad update) naming the
key, as the loader's and ``WEIGHTD_LORA``'s are.
"""

from __future__ import annotations

import json
import subprocess

from tests.vllm.conftest import VLLM_PYTHON

SCRIPT = r"""
import json, math
from weightd.vllm.errors import SettingsError
from weightd.vllm.transfer.engine import WeightdInitInfo, WeightdUpdateInfo
cases = [
    ("update", dict(version=2, timeout=5.0, transport="shm", target="unix:///x.sock")),
    ("update", dict(version=0)),
    ("update", dict(version=True)),
    ("update", dict(version=1, timeout=math.nan)),
    ("update", dict(version=1, timeout=math.inf)),
    ("update", dict(version=1, transport="cuda")),
    ("update", dict(version=1, target="http://h:1")),
    ("update", dict(version=1, verify=1)),
    ("init", dict(timeout=math.nan)),
    ("init", dict(model="")),
    ("init", dict(target="localhost")),
]
out = []
for kind, fields in cases:
    cls = WeightdUpdateInfo if kind == "update" else WeightdInitInfo
    try:
        cls(**fields)
        out.append("ok")
    except SettingsError as exc:
        out.append(f"{isinstance(exc, ValueError)} {exc}")
print(json.dumps(out))
"""


def test_an_updates_info_refuses_what_every_weightd_setting_refuses() -> None:
    run = subprocess.run(
        [str(VLLM_PYTHON), "-c", SCRIPT], capture_output=True, text=True, timeout=600, check=True
    )
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got[0] == "ok"
    refused = got[1:]
    assert all(r.startswith("True ") for r in refused), refused  # ValueErrors, as vLLM expects
    for needle, said in zip(
        [
            "update_info['version'] must name a version",
            "update_info['version'] must be an integer",
            "update_info['timeout'] must be a positive, finite number of seconds",
            "update_info['timeout'] must be a positive, finite number of seconds",
            "update_info['transport'] is 'cuda'; expected one of",
            "update_info['target']: address 'http://h:1'",
            "update_info['verify'] must be true or false",
            "init_info['timeout'] must be a positive, finite number",
            "init_info['model'] must be a non-empty string",
            "init_info['target']",
        ],
        refused,
        strict=True,
    ):
        assert needle in said, said
