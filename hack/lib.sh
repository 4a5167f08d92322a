# Shared helpers for hack/ scripts. Source it: `. "$(dirname "$0")/lib.sh"`.
# Everything built here is cached by version under $HERMIT_CACHE (outside the
# repo), so a second run is fast and a fresh machine still works.
set -euo pipefail

HERMIT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HERMIT_CACHE="${HERMIT_CACHE:-$HOME/.cache/hermit}"
HERMIT_BIN="$HERMIT_CACHE/bin"
HERMIT_VENV="${HERMIT_VENV:-$HERMIT_ROOT/.venv}"
mkdir -p "$HERMIT_CACHE" "$HERMIT_BIN" "$HERMIT_CACHE/locks"
export PATH="$HERMIT_BIN:$PATH"

log() { printf '[hermit %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf '[hermit] error: %s\n' "$*" >&2; exit 1; }

# apt_install PKG...: installs Debian packages that are missing; one
# `apt-get update` per run, only when something is missing.
apt_install() {
  local missing=()
  local p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "apt-get install ${missing[*]}"
  if [ -z "${HERMIT_APT_UPDATED:-}" ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    export HERMIT_APT_UPDATED=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

# go_env: Go builds share one module and build cache under $HERMIT_CACHE.
go_env() {
  export GOPATH="$HERMIT_CACHE/go"
  export GOMODCACHE="$HERMIT_CACHE/go/pkg/mod"
  export GOCACHE="$HERMIT_CACHE/go/build-cache"
  export GOFLAGS="${GOFLAGS:-} -buildvcs=false"
  export CGO_ENABLED="${CGO_ENABLED:-0}"
}

# Locks serialise concurrent runs of the same thing. Lock NAME is the file
# $HERMIT_CACHE/locks/NAME.lock, held with flock(1) on a file descriptor of this
# shell that bash numbers (HERMIT_LOCK_FDS lists them). Processes started while a
# lock is held inherit its descriptor and with it the lock: a daemon meant to
# outlive the script is started after locks_close (see start_daemon).
HERMIT_LOCK_FDS=" "

# lock_take NAME [SECONDS]: takes lock NAME on a new descriptor (HERMIT_LOCK_FD),
# waiting at most SECONDS for it, or as long as it takes; fails on timeout.
lock_take() {
  local wait=()
  [ -z "${2:-}" ] || wait=(-w "$2")
  mkdir -p "$HERMIT_CACHE/locks"
  exec {HERMIT_LOCK_FD}>"$HERMIT_CACHE/locks/$1.lock" || return
  HERMIT_LOCK_FDS+="$HERMIT_LOCK_FD "
  flock "${wait[@]}" "$HERMIT_LOCK_FD"
}

# with_lock NAME CMD...: runs CMD (a command or a shell function) holding lock
# NAME; concurrent callers wait their turn. Returns CMD's status. Call it as a
# plain command: under `if`, `||` or `&&`, errexit is off inside a function CMD.
with_lock() {
  local name=$1 fd rc; shift
  lock_take "$name"
  fd=$HERMIT_LOCK_FD
  "$@"
  rc=$?
  exec {fd}>&-
  HERMIT_LOCK_FDS=${HERMIT_LOCK_FDS/ $fd / }
  return "$rc"
}

# lock_script NAME [SECONDS]: holds lock NAME until this script exits, waiting at
# most SECONDS for it, or as long as it takes; fails on timeout.
lock_script() { lock_take "$@"; }

# locks_close: closes this shell's lock descriptors (in the subshell that
# becomes a daemon).
locks_close() {
  local fd
  for fd in $HERMIT_LOCK_FDS; do exec {fd}>&-; done
  HERMIT_LOCK_FDS=" "
}
