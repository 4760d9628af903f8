#!/usr/bin/env bash
# Quick start (1): set everything up, serve the built-in demo checkpoint, and fetch from it
# the way an inference worker does. The daemon keeps serving until Ctrl-C
# (pass --once to stop right after the client fetch).
set -euo pipefail
cd "$(dirname "$0")/.."
# The demo needs no vLLM: skip its venv unless asked (WEIGHTD_VLLM=1).
WEIGHTD_VLLM=${WEIGHTD_VLLM:-0} bash .ci/setup.sh
sock=${WEIGHTD_DEMO_SOCKET:-$(.venv/bin/python -c 'from weightd.common.sockets import default_socket_path as p; print(p())')}
target="unix://$sock"
.venv/bin/weightd serve --listen "$target" &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null || true; wait $daemon 2>/dev/null || true' EXIT
.venv/bin/weightd health "$target" --wait 120 >/dev/null || { echo "the daemon did not become ready" >&2; exit 1; }
echo
echo "== a worker (rank 1 of 2) fetches its slices from $target"
.venv/bin/python - "$target" <<'PY'
import sys

from weightd.client import WeightClient

client = WeightClient(sys.argv[1], timeout=60)
full = {t.name: t for t in client.describe().tensors}
state, info = client.fetch_with_info(rank=1, world_size=2)  # {name: torch.Tensor}
for name in list(state)[:6] + ["lm_head.weight"]:
    t = state[name]
    print(f"  {name:45s} {str(list(full[name].shape)):>12s} -> {str(list(t.shape)):>12s} {t.dtype}")
got = sum(t.numel() * t.element_size() for t in state.values())
total = sum(t.nbytes for t in full.values())
print(f"  {len(state)} tensors, {got} of the model's {total} bytes")
by = "this client" if info.transport == "grpc" else "the daemon, before sealing the shared pack"
print(f"  served by {info.transport} ({info.reason}); every slice's SHA-256 verified by {by}")
PY
.venv/bin/weightd fetch "$target" --rank 0 --world-size 4 --out "${TMPDIR:-/tmp}/weightd-demo-rank0-of-4.safetensors"
if [ "${1:-}" = "--once" ]; then
  exit 0
fi
echo
echo "weightd is serving the demo checkpoint on $target (Ctrl-C to stop)."
wait $daemon
