#!/usr/bin/env bash
# The whole test suite: set up, lint, type-check, stub drift check, the strict docs
# build, then pytest.
# README quick-start command (2); .ci/run calls exactly this.
#
# --quick (a contributor's loop, a few minutes): the same lint, types, import contracts
# and stub drift check, then the unit tests (tests/unit) only; no apt, no vLLM venv, no
# docs build. Arguments after it go to pytest instead of tests/unit
# (`bash .ci/test.sh --quick tests/unit/config -x`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
quick=
if [ "${1:-}" = --quick ]; then
  quick=1
  shift
  WEIGHTD_SETUP_QUICK=1 bash .ci/setup.sh
else
  bash .ci/setup.sh
fi
export PYTHONDONTWRITEBYTECODE=1
echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy --strict"
.venv/bin/mypy -p weightd.client -p weightd.common -p weightd.server -p weightd.vllm
echo "== import contracts"
.venv/bin/lint-imports
echo "== generated stubs"
PYTHON=.venv/bin/python bash .ci/gen-proto --check
if [ -n "$quick" ]; then
  echo "== pytest (quick: the unit tests; the full command is bash .ci/test.sh)"
  if [ "$#" = 0 ]; then set -- tests/unit; fi
  exec .venv/bin/python -m pytest "$@"
fi
echo "== docs: mkdocs build --strict (broken links, pages missing from the nav, generation errors)"
site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$site"
rm -rf "$site"
echo "== pytest"
exec .venv/bin/python -m pytest "$@"
