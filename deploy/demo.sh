#!/usr/bin/env bash
# Quick start (1): install weightd, serve the built-in demo checkpoint, and fetch from it
# the way an inference worker does. The daemon keeps serving until Ctrl-C
# (pass --once to stop right after the client fetch).
#
# The set-up installs only what the demo needs, into .venv: the package from this clone
# and a CPU torch, in one `pip install torch==2.13.0 .` whose progress pip shows itself.
# No dev tools, no apt, no root (the development set-up is .ci/setup.sh, quick start 2).
# WEIGHTD_TORCH_SPEC picks another torch ("" keeps the one installed); pip's own settings
# (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, e.g. PyTorch's CPU index) apply as usual.
#
# The demo's daemon listens on a socket of its own, in a fresh 0700 directory, so another
# weightd on the default socket is neither used nor disturbed (WEIGHTD_DEMO_SOCKET names a
# path instead; the demo then checks that the daemon answering there is the one it started).
# WEIGHTD_PYTHON: an interpreter that already has weightd installed (skips the set-up).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${WEIGHTD_PYTHON:-}" ]; then
  py=$WEIGHTD_PYTHON
else
  py=.venv/bin/python
  torch_spec=${WEIGHTD_TORCH_SPEC-torch==2.13.0}
  stamp=$( (echo "$torch_spec"; cat pyproject.toml; git rev-parse HEAD 2>/dev/null || true) | sha256sum | cut -c1-16)
  if [ -f .venv/.weightd-setup ] || [ "$(cat .venv/.weightd-demo 2>/dev/null || true)" = "$stamp" ]; then
    echo "== demo: .venv already has weightd (skipping the install)" >&2
  else
    if [ ! -x "$py" ]; then
      echo "== demo: creating .venv with ${PYTHON:-python3}" >&2
      "${PYTHON:-python3}" -m venv .venv
    fi
    echo "== demo: pip install ${torch_spec:+$torch_spec }. (weightd and a CPU torch; a first install takes a minute or two)" >&2
    # --no-compile: pip would byte-compile every module of torch (tens of seconds);
    # Python compiles the few the demo imports when it first imports them.
    pip_flags=(--disable-pip-version-check --no-compile)
    if [ ! -t 2 ]; then pip_flags+=(--progress-bar off); fi
    # shellcheck disable=SC2086 # an empty torch_spec is no argument at all
    "$py" -m pip install "${pip_flags[@]}" $torch_spec . >&2
    echo "$stamp" > .venv/.weightd-demo
  fi
fi
weightd() { "$py" -m weightd.server.cli.main "$@"; }

rundir=$(mktemp -d "${TMPDIR:-/tmp}/weightd-demo.XXXXXX")
sock=${WEIGHTD_DEMO_SOCKET:-$rundir/weightd.sock}
target="unix://$sock"
out="$rundir/rank0-of-4.safetensors" # private to this run (removed with it), not a shared /tmp path

# The daemon gets a process group of its own (set -m): a terminal's Ctrl-C then reaches
# only this script, which stops the daemon with exactly one SIGTERM. In the script's
# group, the daemon would get the terminal's SIGINT and then the clean-up's SIGTERM, and
# count the two as "stop now, abort what is in flight".
set -m
# --layout tp=2: the worker's layout, built in shared memory before the daemon reports
# SERVING, so the worker below maps its slices (no copy over gRPC).
"$py" -m weightd.server.cli.main serve --listen "$target" --layout tp=2 &
daemon=$!
set +m
daemon_status=0
reaped=
napping= # the pid of the current nap's sleep (below)

stop_daemon() {
  if [ -z "$reaped" ]; then
    kill -TERM "$daemon" 2>/dev/null || true
    daemon_status=0
    wait "$daemon" 2>/dev/null || daemon_status=$?
    reaped=1
  fi
}
finish() {
  local status=$?
  trap - EXIT INT TERM HUP
  if [ -n "$napping" ]; then kill "$napping" 2>/dev/null || true; fi
  stop_daemon
  rm -rf "$rundir"
  if [ "$status" = 0 ]; then status=$daemon_status; fi
  exit "$status"
}
trap finish EXIT
trap 'exit 0' INT TERM HUP # then finish: one SIGTERM, the drain, the daemon's exit status

# Waits go through the `wait` builtin on a background sleep, never a foreground `sleep`:
# bash runs a trapped signal's trap at once when it interrupts `wait`, but while a
# foreground child runs it only notes a SIGINT and acts on it if the child died of it
# (bash 5.2 jobs.c, wait_for), so a Ctrl-C that lands just as a foreground `sleep` exits
# by itself would be dropped.
nap() {
  sleep "$1" &
  napping=$!
  wait "$napping" || true
  napping=
}

# Ready means: the daemon this script started is alive, holds the socket's lock, and
# reports SERVING there (not some other weightd that answers on the same path).
for _ in $(seq 240); do
  if ! kill -0 "$daemon" 2>/dev/null; then
    wait "$daemon" || daemon_status=$?
    reaped=1
    echo "the demo's daemon exited (status $daemon_status) before it was ready" >&2
    exit 1
  fi
  if weightd health "$target" >/dev/null 2>&1; then break; fi
  nap 0.5
done
holder=$(cat "$sock.lock" 2>/dev/null || true)
if ! kill -0 "$daemon" 2>/dev/null || [ "$holder" != "$daemon" ]; then
  echo "another daemon (pid ${holder:-unknown}) is serving $target, not the demo's (pid $daemon)" >&2
  exit 1
fi
weightd health "$target" >/dev/null || { echo "the daemon did not become ready" >&2; exit 1; }

echo
echo "== a worker (rank 1 of 2) fetches its slices from $target"
"$py" - "$target" <<'PY'
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
# --progress never: the daemon logs to the same terminal, and its lines would land in
# the middle of a progress line redrawn in place.
weightd fetch "$target" --rank 0 --world-size 4 --out "$out" --progress never
echo "  ($(dirname "$out") is the demo's own directory, removed when the demo stops)"
if [ "${1:-}" = "--once" ]; then
  exit 0
fi
echo
# A shell started with SIGINT ignored (in the background of another script, under some
# supervisors) cannot trap it, and Ctrl-C would do nothing: say so, and what does stop it.
if [ "$(trap -p INT)" = "trap -- '' SIGINT" ]; then # bash's form for an ignored signal
  echo "weightd is serving the demo checkpoint on $target; this shell ignores SIGINT" \
    "(it was started that way), so Ctrl-C cannot stop it: kill $$ (SIGTERM) does."
else
  echo "weightd is serving the demo checkpoint on $target (Ctrl-C to stop)."
fi
# Polled, not one long `wait` on the daemon: a signal that lands just before bash blocks
# in wait(2) would not run its trap until the daemon exited by itself; here it waits for
# the current nap at most.
while kill -0 "$daemon" 2>/dev/null; do nap 0.5; done
wait "$daemon" || daemon_status=$?
reaped=1
