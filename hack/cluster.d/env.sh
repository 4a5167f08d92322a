# Layout, addresses and small helpers of the local cluster (sourced by hack/cluster).
# shellcheck shell=bash
# HERMIT_CLUSTER_INSTANCE=K (0-9, default 0): another cluster beside the first, with its
# own directories, bridge, addresses, ports, netns, veth and cgroup names (hack/test
# ci runs the cluster tests as shards on two). Instance 0 keeps the names it always had;
# instance K's names never contain instance 0's (leftovers and down match by them).
INSTANCE=${HERMIT_CLUSTER_INSTANCE:-0}
[[ $INSTANCE =~ ^[0-9]$ ]] || die "HERMIT_CLUSTER_INSTANCE must be 0-9, not '$INSTANCE'"
if [ "$INSTANCE" = 0 ]; then TAG=""; else TAG="k$INSTANCE"; fi
NET=$((213 + 10 * INSTANCE))          # 10.213 (instance 0), 10.223 (1), ...
CLUSTER_DIR="${HERMIT_CLUSTER_DIR:-$HERMIT_CACHE/${TAG:+$TAG-}cluster}"   # certs, configs, logs, pids
CLUSTER_VAR=/var/lib/hermit-${TAG:+$TAG-}cluster            # etcd, containerd roots, kubelet roots
CLUSTER_RUN=/run/hermit-${TAG:+$TAG-}cluster                # sockets, containerd state, netns mounts
KUBECONFIG_ADMIN="$CLUSTER_DIR/kubeconfig"

BRIDGE=hermit-br$INSTANCE
BRIDGE_IP=10.$NET.0.1                 # host side; kube-apiserver listens here
BRIDGE_MAC=02:68:72:6d:0$INSTANCE:01  # locally administered, fixed (controlplane.sh net_up)
NODE_NET_PREFIX=10.$NET.0             # node i: 10.213.0.(10+i)
POD_NET_PREFIX=10.$((NET + 1))        # node i: 10.214.i.0/24
CLUSTER_CIDR=$POD_NET_PREFIX.0.0/16
SERVICE_CIDR=10.$((NET + 2)).0.0/16
KUBERNETES_SVC_IP=10.$((NET + 2)).0.1
APISERVER_PORT=6443                   # on BRIDGE_IP: the same port on every instance
ETCD_CLIENT_PORT=$((23790 + INSTANCE))
ETCD_PEER_PORT=$((23800 + INSTANCE))
CONTROLLER_MANAGER_PORT=$((10257 + 100 * INSTANCE))  # on 127.0.0.1 (its default 10257)
SCHEDULER_PORT=$((10259 + 100 * INSTANCE))           # on 127.0.0.1 (its default 10259)
AEMM_PORT=1338
REGISTRY_PORT=$((5100 + INSTANCE))    # on BRIDGE_IP (hack/cluster registry)
CGROUP_ROOT=hermit$TAG                # /sys/fs/cgroup/<ctrl>/hermit/<node>
NETNS_PREFIX=hermit$TAG-              # a node's network namespace: hermit-<node>
VETH_PREFIX=h${TAG}mv                 # host side of node i's veth: hmv<i>
APISERVER_URL="https://$BRIDGE_IP:$APISERVER_PORT"
IMDS_ANNOTATION=hermit.dev/imds-url
DEFAULT_NODES=(spot-1:spot spot-2:spot ondemand-1:on-demand)
IMAGES=(pause sandbox hermit init)   # hack/images/build names; imported into every node
# Nodes whose name matches this bash pattern run containerd 2 and runc 1.5
# (hack/install-containerd2); the others Debian's containerd 1.6 (docs/cluster.md#runtimes).
# The default, the even-numbered spot nodes, makes a move between spot-1 and spot-2 cross
# runtimes. "" puts every node on Debian's.
CONTAINERD2_NODES=${HERMIT_CLUSTER_CONTAINERD2_NODES-spot-*[02468]}
CONTAINERD2_BIN=$HERMIT_CACHE/bin/containerd2

kctl() { "$HERMIT_BIN/kubectl" --kubeconfig "$KUBECONFIG_ADMIN" "$@"; }

# cgroup hierarchies the node cgroups live in (the kubelet also uses the unified one).
cgroup_ctrls() {
  local d
  for d in /sys/fs/cgroup/*/; do
    d=${d%/}; d=${d##*/}
    [ -f "/sys/fs/cgroup/$d/cgroup.procs" ] && echo "$d"
  done
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# wait_for DESCRIPTION SECONDS CMD...: polls CMD every 0.5 s until it succeeds.
wait_for() {
  local what=$1 secs=$2; shift 2
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || die "timed out after ${secs}s waiting for $what"
    sleep 0.5
  done
}

# start_daemon NAME LOG CMD...: runs CMD detached (own session, without this
# shell's locks), pid in $CLUSTER_DIR/pids/NAME.
start_daemon() {
  local name=$1 logf=$2; shift 2
  local pidf="$CLUSTER_DIR/pids/$name.pid"
  mkdir -p "$CLUSTER_DIR/pids" "$(dirname "$logf")"
  if pid_alive "$pidf"; then return 0; fi
  ( locks_close; close_inherited_fds; exec setsid "$@" ) </dev/null >>"$logf" 2>&1 &
  echo $! >"$pidf"
}

# close_inherited_fds: closes every descriptor above 2 of this (sub)shell, so a daemon
# holds nothing of its caller's, such as a lock a CI runner or `flock CMD` took.
close_inherited_fds() {
  local fd
  for fd in /proc/"$BASHPID"/fd/*; do
    fd=${fd##*/}
    # The braces: `exec {fd}>&- 2>/dev/null` alone would send this shell's stderr, and
    # with it the daemon's, to /dev/null for good (its log got stdout only).
    if [ "$fd" -gt 2 ]; then { exec {fd}>&-; } 2>/dev/null || true; fi
  done
}

# stop_daemon NAME: SIGTERM, then SIGKILL after 10 s.
stop_daemon() {
  local pidf="$CLUSTER_DIR/pids/$1.pid"
  [ -f "$pidf" ] || return 0
  local pid; pid=$(cat "$pidf")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + 10))
    while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$pidf"
}
