#!/usr/bin/env bash
# New content reaching running engines, in one run (issue 45, point 7): a trainer's new
# weights (memory, directory, vLLM's reload), pack builds at a start and a publish, a new
# adapter's first request, engine loads, and an s3:// start; each benchmark prints its
# own rows with the load average per row.
#
#   bash bench/new_content.sh [OUT_DIR]       # needs .venv and .venv-vllm (.ci/setup.sh)
#
# Quote a quiet run only: nothing else on the host (`cat /proc/loadavg` near 0 first).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results/new_content-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$out"
# An installed daemon starts from compiled modules; a checkout with
# PYTHONDONTWRITEBYTECODE set would compile them at every start, inside the timings.
.venv/bin/python -m compileall -q server client bench >/dev/null
.venv-vllm/bin/python -m compileall -q server client bench >/dev/null
step() {
  local name=$1; shift
  echo "== $name: $* (load $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%H:%M:%S))"
  "$@" 2>"$out/$name.err" | tee "$out/$name.txt"
  echo "== $name: rc ${PIPESTATUS[0]} (load $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%H:%M:%S))"
}
step update .venv-vllm/bin/python bench/vllm_update.py --tp 1,2 --rounds 1 \
  --trainer-rounds 2 --json "$out/update.json"
step packs .venv/bin/python bench/pack_build.py --rounds 2
step lora .venv/bin/python bench/vllm_lora.py --only latency --rounds 2 --swaps 10 \
  --json "$out/lora.json"
step load-1.1GB .venv-vllm/bin/python bench/vllm_load.py --cases first,second \
  --loaders weightd,auto --json "$out/load-1.1GB.json"
step load-0.4GB .venv-vllm/bin/python bench/vllm_load.py --layers 2 --cases first,second \
  --loaders weightd,auto --json "$out/load-0.4GB.json"
step s3 .venv/bin/python bench/s3_load.py --repeat 3 --skip-runai
echo "results in $out"
