#!/usr/bin/env bash
# Every GPU test, then the short GPU benchmark, on one GPU, in under 8 minutes.
#
#   bash tests/gpu/run_all.sh            # uses .venv; needs a CUDA build of torch in it
#
# On a GPU host set the venv up with the CUDA torch you have (WEIGHTD_TORCH_SPEC=""
# keeps the installed one, see docs/guides/install.md) before running this. NOT RUN YET: weightd was
# developed without a GPU; this is the script to run where one exists.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY=${PYTHON:-.venv/bin/python}
"$PY" - <<'PY'
import sys, torch
from weightd.common.cuda_driver import CudaDriver
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no GPU: install a CUDA build (see docs/guides/install.md)")
d = CudaDriver.load()
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {d.device_count()} GPU(s): "
      + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
PY
start=$(date +%s)
echo "== GPU tests"
timeout 270 "$PY" -m pytest -m gpu tests/gpu tests/adapters/test_adapter_cuda_ipc.py tests/reliability/test_resources.py -v -s -p no:cacheprovider
echo "== GPU benchmark"
timeout 180 "$PY" bench/gpu_bench.py --repeat 3
echo "== done in $(( $(date +%s) - start )) s"
