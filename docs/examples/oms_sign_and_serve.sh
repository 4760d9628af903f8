#!/usr/bin/env bash
# Sign a checkpoint once with the OpenSSF Model Signing tool (`model_signing`, from the
# `model-signing` package), then check and serve it with weightd. Needs `weightd`,
# `model_signing` and `openssl` on PATH (`pip install ".[signing]"` from a clone).
#
#   bash docs/examples/oms_sign_and_serve.sh /path/to/checkpoint OUTPUT_DIR
#
# Writes an EC P-256 key pair and the signature into OUTPUT_DIR (not into the
# checkpoint), then runs what `weightd serve --signature ... --trust-key ...` runs
# before serving anything, and serves it.
set -euo pipefail
model_dir=${1:?usage: oms_sign_and_serve.sh CHECKPOINT_DIR OUTPUT_DIR}
out=${2:?usage: oms_sign_and_serve.sh CHECKPOINT_DIR OUTPUT_DIR}
mkdir -p "$out"

# Where the model is made: a key pair (the private key 0600; keep it off serving hosts)
# and one signature over every file of the directory, with the standard tool.
(umask 077 && openssl ecparam -name prime256v1 -genkey -noout -out "$out/signing.pem")
openssl ec -in "$out/signing.pem" -pubout -out "$out/signing.pub"
model_signing sign key "$model_dir" --private_key "$out/signing.pem" --signature "$out/model.sig"

# Where it is served: what the signature proves (the signer's key, every file and its
# SHA-256). Exit status 0 only when the directory is exactly what was signed.
weightd verify "$model_dir" --signature "$out/model.sig" --trust-key "$out/signing.pub"

# Serve it: refused in one line, before serving, if anything differs.
run=$(mktemp -d)
target="unix://$run/weightd.sock"
weightd serve --model "mymodel=$model_dir" --signature "mymodel=$out/model.sig" \
    --trust-key "$out/signing.pub" --listen "$target" &
daemon=$!
trap 'kill "$daemon"; wait "$daemon" || true; rm -rf "$run"' EXIT
weightd health "$target" --wait 120
weightd list "$target" # ... trust oms-key:sha256:<the key's fingerprint>
