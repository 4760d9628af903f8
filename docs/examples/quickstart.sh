#!/usr/bin/env bash
# The quick start with your own checkpoint: verify it, see each worker's share at TP=2,
# serve it, and fetch as workers do. Needs `weightd` on PATH (pip install . from a clone).
#
#   bash docs/examples/quickstart.sh /path/to/checkpoint
#
# The checkpoint is a Hugging Face-style directory: config.json, *.safetensors shards
# and their index (or one model.safetensors).
set -euo pipefail
model_dir=${1:?usage: quickstart.sh CHECKPOINT_DIR}
here=$(dirname "${BASH_SOURCE[0]}")

# 1. Everything the daemon will check before it serves: headers, index, config, digests.
weightd verify "$model_dir"

# 2. What each of two tensor-parallel workers would receive (reads headers only).
weightd plan "$model_dir" --tp 2

# 3. Serve it. The socket goes in a private (0700) directory of our own here; without
#    --listen the daemon uses its default socket (`weightd config show` prints it).
run=$(mktemp -d)
target="unix://$run/weightd.sock"
weightd serve --model "mymodel=$model_dir" --listen "$target" &
daemon=$!
trap 'kill "$daemon"; wait "$daemon" || true; rm -rf "$run"' EXIT
weightd health "$target" --wait 120 # exit 0 once every model is verified and SERVING
weightd list "$target"

# 4. Fetch as a worker: rank 1 of 2 into a file, then from Python.
weightd fetch "$target" --rank 1 --world-size 2 --out "$run/rank1-of-2.safetensors"
python3 "$here/fetch_rank.py" "$target" --rank 0 --world-size 2
