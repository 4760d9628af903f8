#!/usr/bin/env bash
# Sign a checkpoint where it is produced, check it where it is served.
#
#   bash docs/examples/sign_and_verify.sh /path/to/checkpoint OUTPUT_DIR
#
# Writes an Ed25519 key pair and a signed manifest into OUTPUT_DIR, then runs the check
# `weightd serve --manifest ... --trust-key ...` runs before serving anything.
set -euo pipefail
model_dir=${1:?usage: sign_and_verify.sh CHECKPOINT_DIR OUTPUT_DIR}
out=${2:?usage: sign_and_verify.sh CHECKPOINT_DIR OUTPUT_DIR}
mkdir -p "$out"

# Where the model is made: a key pair (the private key 0600; keep it off serving hosts)
# and a manifest of every file and tensor, signed. It refuses a directory that does not
# verify.
weightd manifest keygen --out-private "$out/release.key" --out-public "$out/release.pub"
weightd manifest create "$model_dir" -o "$out/manifest.json" --sign-key "$out/release.key"

# Where it is served: the same checks as serve's, against the manifest and the public key.
# Exit status 0 only when every file, tensor and the signature hold.
weightd verify "$model_dir" --manifest "$out/manifest.json" --trust-key "$out/release.pub"

# Then: weightd serve --model "mymodel=$model_dir" \
#         --manifest "mymodel=$out/manifest.json" --trust-key "$out/release.pub"
