# Waiting for apt's and dpkg's locks with a bound, for scripts that run apt-get as root.
# Sourced by .ci/setup.sh (and its test); defines apt_wait_locks and apt_get.
#
# On a fresh cloud VM, unattended upgrades hold /var/lib/dpkg/lock-frontend (and the
# lists lock) for minutes after boot, and apt-get fails at once with exit 100. apt's own
# `-o DPkg::Lock::Timeout=N` waits for the dpkg locks but not for the lists lock that
# `apt-get update` takes, so the wait is done here: dpkg and apt lock their files with
# fcntl, which /proc/locks lists (read-only: this never takes a lock itself), and a held
# lock is waited for up to WEIGHTD_APT_LOCK_TIMEOUT seconds (default 300), saying which
# process holds it. An apt-get that still loses the race is tried again within the bound.

APT_LOCKS=${WEIGHTD_APT_LOCKS:-/var/lib/dpkg/lock-frontend /var/lib/dpkg/lock /var/lib/apt/lists/lock /var/cache/apt/archives/lock}
APT_LOCK_TIMEOUT=${WEIGHTD_APT_LOCK_TIMEOUT:-300}
_apt_deadline=

# The pid holding a POSIX lock on file $1 (nothing if none, or the file is missing).
apt_lock_holder() {
  local ino
  ino=$(stat -c %i "$1" 2>/dev/null) || return 0
  awk -v ino="$ino" '$2 == "POSIX" || $2 == "OFDLCK" { n = split($6, a, ":"); if (a[n] == ino) { print $5; exit } }' /proc/locks
}

# Wait until none of APT_LOCKS is held; fail (status 1) past the bound, in one line.
apt_wait_locks() {
  if [ -z "$_apt_deadline" ]; then _apt_deadline=$((SECONDS + APT_LOCK_TIMEOUT)); fi
  local lock pid said=
  while :; do
    pid=
    for lock in $APT_LOCKS; do
      pid=$(apt_lock_holder "$lock")
      if [ -n "$pid" ]; then break; fi
    done
    if [ -z "$pid" ]; then return 0; fi
    if [ "$SECONDS" -ge "$_apt_deadline" ]; then
      echo "error: $lock is still held by pid $pid ($(cat "/proc/$pid/comm" 2>/dev/null || echo '?')) after ${APT_LOCK_TIMEOUT}s; wait for it to finish (unattended upgrades after boot take minutes) or raise WEIGHTD_APT_LOCK_TIMEOUT" >&2
      return 1
    fi
    if [ -z "$said" ]; then
      echo "== waiting for $lock, held by pid $pid ($(cat "/proc/$pid/comm" 2>/dev/null || echo '?')), up to ${APT_LOCK_TIMEOUT}s" >&2
      said=1
    fi
    sleep 1
  done
}

# apt-get "$@" once the locks are free; tried again while it loses them to another
# process, within the same bound.
apt_get() {
  local status errors
  errors=$(mktemp)
  while :; do
    apt_wait_locks || { rm -f "$errors"; return 1; }
    status=0
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=$((_apt_deadline - SECONDS > 0 ? _apt_deadline - SECONDS : 0)) "$@" 2>"$errors" || status=$?
    if [ "$status" = 0 ] || ! grep -q "Could not get lock" "$errors"; then
      cat "$errors" >&2
      rm -f "$errors"
      return "$status"
    fi
  done
}
