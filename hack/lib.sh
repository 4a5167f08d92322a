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

# with_lock NAME CMD...: serialises concurrent builds of the same thing.
with_lock() {
  local name=$1; shift
  mkdir -p "$HERMIT_CACHE/locks"
  flock "$HERMIT_CACHE/locks/$name.lock" "$@"
}
