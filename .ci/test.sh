#!/usr/bin/env bash
# The whole test suite: set up, lint, type-check, stub drift check, the strict docs
# build, then pytest.
# README quick-start command (2); .ci/run calls exactly this.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash .ci/setup.sh
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
echo "== docs: mkdocs build --strict (broken links, pages missing from the nav, generation errors)"
site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$site"
rm -rf "$site"
echo "== pytest"
exec .venv/bin/python -m pytest "$@"
