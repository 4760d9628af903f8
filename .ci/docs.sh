#!/usr/bin/env bash
# The documentation site from a fresh clone, with one command:
#
#   bash .ci/docs.sh          # build it strictly into site/ (what CI's build checks)
#   bash .ci/docs.sh serve    # serve it on http://127.0.0.1:8000, rebuilt as you edit
#
# It installs exactly what the site needs into .venv: weightd with the [docs] extra
# (MkDocs, Material, mkdocstrings, and grpcio-tools, whose protoc the wire-contract page
# is generated with) and torch's CPU build (the reference pages import weightd, which
# imports torch). WEIGHTD_TORCH_SPEC picks another torch ("" keeps the installed one),
# as for the demo and the test command.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${WEIGHTD_TORCH_SPEC-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
  echo "== docs: creating .venv with $PYTHON" >&2
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import mkdocs, material, mkdocstrings, grpc_tools, weightd.server.cli.main" 2>/dev/null; then
  echo "== docs: pip install ${TORCH_SPEC:+$TORCH_SPEC }-e \".[docs]\"" >&2
  # shellcheck disable=SC2086 # an empty TORCH_SPEC is no argument at all
  .venv/bin/python -m pip install --disable-pip-version-check $TORCH_SPEC -e ".[docs]" >&2
fi
export NO_MKDOCS_2_WARNING=1
case "${1:-build}" in
  build) exec .venv/bin/mkdocs build --strict --site-dir "${SITE_DIR:-site}" ;;
  serve) exec .venv/bin/mkdocs serve ;;
  *) echo "usage: bash .ci/docs.sh [build|serve]" >&2; exit 1 ;;
esac
