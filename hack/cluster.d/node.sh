# One Kubernetes node = a network namespace on the host bridge + a cgroup subtree
# + its own containerd, kubelet, kube-proxy and instance-metadata mock (AEMM).
# Sourced by hack/cluster.
# shellcheck shell=bash

node_dir() { echo "$CLUSTER_DIR/nodes/$1"; }
node_exists() { [ -f "$(node_dir "$1")/index" ]; }
node_names() { local d; for d in "$CLUSTER_DIR"/nodes/*/index; do [ -f "$d" ] && basename "$(dirname "$d")"; done; return 0; }
node_index() { cat "$(node_dir "$1")/index"; }
node_ip() { echo "$NODE_NET_PREFIX.$((10 + $(node_index "$1")))"; }
node_capacity() { cat "$(node_dir "$1")/capacity"; }
node_imds_url() { echo "http://$(node_ip "$1"):$AEMM_PORT"; }
node_sock() { echo "$CLUSTER_RUN/$1/containerd/containerd.sock"; }  # host view

node_alloc() {  # node_alloc NAME CAPACITY: reserves an index (1..200) for NAME
  local name=$1 cap=$2 dir i used
  dir=$(node_dir "$name")
  node_exists "$name" && return 0
  used=" $(cat "$CLUSTER_DIR"/nodes/*/index 2>/dev/null | tr "\n" " " || true) "
  for i in $(seq 1 200); do
    case $used in *" $i "*) continue ;; esac
    mkdir -p "$dir"; echo "$cap" >"$dir/capacity"; echo "$i" >"$dir/index"; return 0
  done
  die "no free node index"
}

node_mac() { printf '02:68:72:6e:%02x:%02x' "$INSTANCE" "$1"; }  # node_mac INDEX (1-200)
veth_gone() { ! ip link show "$1" >/dev/null 2>&1; }

node_net_up() {
  local name=$1 i ip ns=$NETNS_PREFIX$1 veth
  i=$(node_index "$name"); ip=$(node_ip "$name"); veth="$VETH_PREFIX$i"
  if ! ip netns list | grep -qw "$ns"; then ip netns add "$ns"; fi
  # A node added again under its old index finds the old veth still there for a while:
  # `ip netns del` returns before the kernel tears the old namespace and its veth
  # pair down. That veth leads nowhere, so it is removed (and waited out) first.
  if ip link show "$veth" >/dev/null 2>&1 \
      && ! ip -n "$ns" -o addr show dev eth0 2>/dev/null | grep -qF " $ip/24 "; then
    ip link del "$veth" 2>/dev/null || true
    wait_for "the old $veth to go" 30 veth_gone "$veth"
  fi
  if ! ip link show "$veth" >/dev/null 2>&1; then
    # A fixed MAC per index: a node added again under its old index (and IP) is reached
    # at once. With a new random MAC, the host's and the other nodes' neighbour entries
    # for that IP still named the old one, and packets to it (a curl of its AEMM) were
    # dropped until they went stale, up to a minute later.
    ip link add "$veth" type veth peer name eth0 address "$(node_mac "$i")" netns "$ns"
    ip link set "$veth" master "$BRIDGE" up
    ip -n "$ns" addr add "$ip/24" dev eth0
    ip neigh del "$ip" dev "$BRIDGE" 2>/dev/null || true
  fi
  ip -n "$ns" link set lo up
  ip -n "$ns" link set eth0 up
  ip -n "$ns" route replace default via "$BRIDGE_IP"
  ip route replace "$POD_NET_PREFIX.$i.0/24" via "$ip"
  ip netns exec "$ns" sysctl -qw net.ipv4.ip_forward=1
  ip netns exec "$ns" sysctl -qw net.bridge.bridge-nf-call-iptables=1 2>/dev/null || true
  # the well-known IMDS address reaches this node's AEMM, as on EC2, for
  # hostNetwork processes (OUTPUT) and pods (PREROUTING) alike
  local chain rule
  for chain in PREROUTING OUTPUT; do
    rule=(-d 169.254.169.254/32 -p tcp --dport 80 -j DNAT --to-destination "$ip:$AEMM_PORT")
    ip netns exec "$ns" iptables -t nat -C "$chain" "${rule[@]}" 2>/dev/null \
      || ip netns exec "$ns" iptables -t nat -A "$chain" "${rule[@]}"
  done
}

node_cgroups_up() {
  local name=$1 c base lvl
  for c in $(cgroup_ctrls); do
    base=/sys/fs/cgroup/$c
    for lvl in "$CGROUP_ROOT" "$CGROUP_ROOT/$name" "$CGROUP_ROOT/$name/daemons"; do
      [ -d "$base/$lvl" ] && continue
      mkdir "$base/$lvl"
      if [ "$c" = cpuset ]; then  # a cpuset child starts empty: inherit the parent's
        cat "$(dirname "$base/$lvl")/cpuset.cpus" >"$base/$lvl/cpuset.cpus"
        cat "$(dirname "$base/$lvl")/cpuset.mems" >"$base/$lvl/cpuset.mems"
      fi
    done
  done
}

# node_cgroup_pids NAME: every pid in the node's cgroup subtree (pids hierarchy, else any).
node_cgroup_pids() {
  local c d
  for c in pids memory cpu; do
    d=/sys/fs/cgroup/$c/$CGROUP_ROOT/$1
    [ -d "$d" ] || continue
    find "$d" -name cgroup.procs -exec cat {} + 2>/dev/null
    return 0
  done
}

node_cgroups_down() {
  local c d
  for c in $(cgroup_ctrls); do
    d=/sys/fs/cgroup/$c/$CGROUP_ROOT/$1
    [ -d "$d" ] && { find "$d" -depth -type d -exec rmdir {} + 2>/dev/null || true; }
    [ -d "$d" ] && log "warning: cgroup $d still present"
  done
  return 0
}

# Paths that are per node inside the node's mount namespace: "standard path:host dir".
node_bind_map() {
  local var=$CLUSTER_VAR/$1 run=$CLUSTER_RUN/$1
  echo "/var/lib/kubelet:$var/kubelet /var/lib/containerd:$var/containerd /run/containerd:$run/containerd"
  echo "/var/lib/hermit:$var/hermit /var/log/pods:$var/pod-logs /var/log/containers:$var/container-logs"
  echo "/var/lib/cni:$var/cni"
}

# node_mntns_up NAME: a persistent mount namespace (file $CLUSTER_RUN/mntns/NAME)
# with the node's directories bound over the standard paths. Mounts made in it
# (container roots, volumes, pod netns) stay in it and vanish with it; the binds
# are shared mounts (as on a systemd host) so HostToContainer propagation works.
node_mntns_up() {
  local name=$1 nsdir=$CLUSTER_RUN/mntns pair dst src binds=""
  [ -e "$nsdir/$name" ] && mountpoint -q "$nsdir/$name" && return 0
  mkdir -p "$nsdir"
  if ! mountpoint -q "$nsdir"; then mount --bind "$nsdir" "$nsdir"; fi
  mount --make-private "$nsdir"
  for pair in $(node_bind_map "$name"); do
    dst=${pair%%:*}; src=${pair#*:}
    mkdir -p "$dst" "$src"
    binds+="mount --bind '$src' '$dst'; "
  done
  touch "$nsdir/$name"
  # inside: drop the copies of other nodes' namespace files, then bind
  unshare --mount="$nsdir/$name" --propagation slave \
    sh -c "umount -l '$nsdir' 2>/dev/null || true; $binds mount --make-rshared /" \
    || die "creating the mount namespace of $name failed"
}

node_mntns_down() {
  local f=$CLUSTER_RUN/mntns/$1
  if [ -e "$f" ]; then umount "$f" 2>/dev/null || umount -l "$f" 2>/dev/null || true; rm -f "$f"; fi
}

# node_write_configs NAME: the node's config files in its dir (its kubeconfig is
# pki_node's), and its directories under $CLUSTER_VAR and $CLUSTER_RUN.
node_write_configs() {
  local name=$1 dir
  dir=$(node_dir "$name")
  mkdir -p "$dir/cni" "$CLUSTER_VAR/$name" "$CLUSTER_RUN/$name"
  node_containerd_config "$name" >"$dir/containerd.toml"
  mkdir -p "$dir/certs.d/$REGISTRY_HOST"
  node_registry_hosts >"$dir/certs.d/$REGISTRY_HOST/hosts.toml"
  node_cni_config "$name" >"$dir/cni/10-hermit.conflist"
  node_kubelet_config "$name" >"$dir/kubelet.yaml"
  node_labels "$name" >"$dir/labels"
  node_kube_proxy_config "$name" >"$dir/kube-proxy.yaml"
}

# node_containerd_config NAME: containerd's config.toml; its CNI config is in
# the node's dir.
node_containerd_config() {
  local dir
  dir=$(node_dir "$1")
  cat <<TOML
version = 2
# paths as seen in the node's mount namespace (node_bind_map)
root = "/var/lib/containerd"
state = "/run/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "/run/containerd/containerd.sock"

[ttrpc]
  address = "/run/containerd/containerd.sock.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "/var/lib/containerd/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "hermit.local/pause:3.10"
  netns_mounts_under_state_dir = true
  disable_apparmor = true
  # no CAP_SYS_RESOURCE here: clamp oom_score_adj (-998 for pause) to what we may set
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "/run/containerd/runc"
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "$dir/certs.d"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$dir/cni"
    max_conf_num = 1
TOML
}

# node_cni_config NAME: the CNI network (bridge cni0, host-local IPAM on the
# node's pod CIDR).
node_cni_config() {
  local i
  i=$(node_index "$1")
  cat <<JSON
{
  "cniVersion": "0.4.0",
  "name": "hermit",
  "plugins": [
    {
      "type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$POD_NET_PREFIX.$i.0/24"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
JSON
}

# node_kubelet_config NAME: the KubeletConfiguration.
node_kubelet_config() {
  local name=$1 i ip
  i=$(node_index "$name"); ip=$(node_ip "$name")
  cat <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $ip
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI/ca.crt}
authorization: {mode: Webhook}
tlsCertFile: $PKI/node-$name-serving.crt
tlsPrivateKeyFile: $PKI/node-$name-serving.key
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
# cgroup v1 with several kubelets on one host: cgroupfs driver, one cgroup root per node
cgroupDriver: cgroupfs
cgroupsPerQOS: true
cgroupRoot: /$CGROUP_ROOT/$name
failCgroupV1: false
failSwapOn: false
enforceNodeAllocatable: [pods]
podCIDR: $POD_NET_PREFIX.$i.0/24
resolvConf: /etc/resolv.conf
maxPods: 60
# locally built images cannot be pulled again: never garbage-collect them
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
serializeImagePulls: false
rotateCertificates: false
serverTLSBootstrap: false
protectKernelDefaults: false
YAML
}

# The spot label of each provider's convention. A spot node carries ONE of them, in turn
# by the number its name ends in (spot-1 Karpenter, spot-2 EKS, spot-3 GKE Spot,
# spot-4 GKE provisioning, spot-5 AKS, spot-6 Karpenter, ...; the node index for a name
# without one), so the e2e tests see Hermit's spot affinity match each convention.
SPOT_CONVENTIONS=(karpenter.sh/capacity-type=spot eks.amazonaws.com/capacityType=SPOT
  cloud.google.com/gke-spot=true cloud.google.com/gke-provisioning=spot
  kubernetes.azure.com/scalesetpriority=spot)

# node_labels NAME: the node's labels (instance type, zone, capacity type: one convention's
# spot label, or Karpenter's on-demand value), comma-separated for kubelet --node-labels.
node_labels() {
  local name=$1 i n labels
  i=$(node_index "$name")
  labels="node.kubernetes.io/instance-type=hermit-local,topology.kubernetes.io/zone=local-$(( (i - 1) % 2 + 1 ))"
  if [ "$(node_capacity "$name")" = spot ]; then
    n=$i; [[ $name =~ -([0-9]+)$ ]] && n=$((10#${BASH_REMATCH[1]}))
    labels+=",${SPOT_CONVENTIONS[$(( (n + ${#SPOT_CONVENTIONS[@]} - 1) % ${#SPOT_CONVENTIONS[@]} ))]}"
  else
    labels+=",karpenter.sh/capacity-type=on-demand"
  fi
  echo "$labels"
}

# node_kube_proxy_config NAME: the KubeProxyConfiguration (iptables mode).
node_kube_proxy_config() {
  local name=$1 ip
  ip=$(node_ip "$name")
  cat <<YAML
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $CLUSTER_DIR/kube-proxy.kubeconfig}
mode: iptables
clusterCIDR: $CLUSTER_CIDR
hostnameOverride: $name
bindAddress: $ip
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
conntrack: {maxPerCore: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
YAML
}

# node_aemm NAME [AEMM ARGS...]: (re)starts the node's metadata mock on IP:1338.
# Normal mode serves every path with the spot notice and rebalance recommendation
# held back for ten years.
node_aemm() {
  local name=$1; shift
  stop_daemon "$name-aemm"
  local args=("$@")
  [ ${#args[@]} -gt 0 ] || args=(--mock-delay-sec 315360000 --rebalance-delay-sec 315360000)
  start_daemon "$name-aemm" "$CLUSTER_DIR/logs/$name/aemm.log" \
    nsenter --net="/run/netns/$NETNS_PREFIX$name" -- \
    env HOME="$(node_dir "$name")" "$HERMIT_BIN/ec2-metadata-mock" "${args[@]}" \
    --hostname "$(node_ip "$name")" --port "$AEMM_PORT" --mock-ip-count 1000
  wait_for "AEMM of $name" 60 curl -sf "$(node_imds_url "$name")/latest/meta-data/instance-id"
}

# node_runtime_bin NAME: the directory whose containerd, shim, ctr and runc the node runs
# (first on its PATH), or nothing for Debian's on the host's PATH (CONTAINERD2_NODES).
node_runtime_bin() {
  [ -n "$CONTAINERD2_NODES" ] || return 0
  # shellcheck disable=SC2053  # CONTAINERD2_NODES is a pattern
  if [[ $1 == $CONTAINERD2_NODES ]]; then echo "$CONTAINERD2_BIN"; fi
  return 0
}

# node_ctr NAME ARGS...: the node's own ctr on its containerd.
node_ctr() {
  local name=$1 bin; shift
  bin=$(node_runtime_bin "$name")
  "${bin:+$bin/}ctr" --address "$(node_sock "$name")" "$@"
}

node_import_images() {
  local name=$1 img tar done_f
  done_f="$(node_dir "$name")/images.imported"
  touch "$done_f"
  for img in ${NODE_IMAGES:-${IMAGES[*]}}; do
    tar=$(readlink -f "$HERMIT_CACHE/images/$img.tar")
    # Skip only when this tar is the last one imported for the image: another worktree's
    # build of the same image (same ref) may have been imported since.
    [ "$(grep -F "/$img-" "$done_f" | tail -n 1)" = "$tar" ] && continue
    # (containerd 2's ctr repeats the daemon's cgroup v1 deprecation warning per call)
    node_ctr "$name" -n k8s.io images import --no-unpack=false "$tar" >/dev/null \
      2> >(grep -v "support for cgroup v1 is deprecated" >&2) \
      || die "importing $tar into $name failed"
    echo "$tar" >>"$done_f"
  done
}

# node_prepare NAME CAPACITY: the host-side setup (index, netns, cgroups, certs,
# configs); serial, because `ip netns add` and cgroup mkdir race with themselves.
node_prepare() {
  local name=$1 cap=$2
  node_alloc "$name" "$cap"
  mkdir -p "$CLUSTER_DIR/logs/$name"
  node_net_up "$name"
  node_cgroups_up "$name"
  node_mntns_up "$name"
  pki_node "$name" "$(node_ip "$name")"
  node_write_configs "$name"
}

# node_start NAME: starts the node's daemons, waits until it is registered (parallel-safe).
node_start() {
  local name=$1 dir logs
  dir=$(node_dir "$name"); logs=$CLUSTER_DIR/logs/$name
  local innode=("$HERMIT_ROOT/hack/cluster.d/in-node" "$name") bin
  bin=$(node_runtime_bin "$name")
  if [ -n "$bin" ] && [ ! -x "$bin/containerd" ]; then
    die "node $name runs containerd 2 (HERMIT_CLUSTER_CONTAINERD2_NODES='$CONTAINERD2_NODES'), which is not built: run hack/install-containerd2"
  fi
  # containerd starts the shim it finds first on its PATH, and the shim that runc.
  start_daemon "$name-containerd" "$logs/containerd.log" "${innode[@]}" \
    env PATH="${bin:+$bin:}$PATH" containerd --config "$dir/containerd.toml"
  wait_for "containerd of $name" 30 node_ctr "$name" version
  node_import_images "$name"
  pid_alive "$CLUSTER_DIR/pids/$name-aemm.pid" || node_aemm "$name"
  start_daemon "$name-kubelet" "$logs/kubelet.log" "${innode[@]}" \
    "$HERMIT_BIN/kubelet" --config "$dir/kubelet.yaml" --kubeconfig "$dir/kubelet.kubeconfig" \
    --root-dir /var/lib/kubelet --hostname-override "$name" \
    --node-ip "$(node_ip "$name")" --node-labels "$(cat "$dir/labels")" --v=1
  start_daemon "$name-kube-proxy" "$logs/kube-proxy.log" "${innode[@]}" \
    "$HERMIT_BIN/kube-proxy" --config "$dir/kube-proxy.yaml" --v=1
  wait_for "node $name registered" 90 kctl get node "$name"
  kctl annotate --overwrite node "$name" "$IMDS_ANNOTATION=$(node_imds_url "$name")" >/dev/null
}

node_up() {  # node_up NAME CAPACITY: one node, up to registered (idempotent)
  node_prepare "$1" "$2"
  node_start "$1"
}

# node_thaw NAME: a SIGKILL waits until a frozen task thaws (a checkpoint freezes the
# sandbox), so a node that dies mid-checkpoint is thawed for its kill to land.
node_thaw() {
  local f
  for f in $(find "/sys/fs/cgroup/freezer/$CGROUP_ROOT/$1" -name freezer.state 2>/dev/null); do
    echo THAWED >"$f" 2>/dev/null || true
  done
  for f in $(find "/sys/fs/cgroup/unified/$CGROUP_ROOT/$1" "/sys/fs/cgroup/$CGROUP_ROOT/$1" \
      -name cgroup.freeze 2>/dev/null); do
    echo 0 >"$f" 2>/dev/null || true
  done
}

# node_kill NAME: the node vanishes as a cloud VM does: every process of it
# (kubelet, containerd, shims, containers, AEMM) killed, mounts, netns and
# cgroups removed. The Node object is left to the caller.
node_kill() {
  local name=$1 pids tries=0
  stop_daemon "$name-aemm"
  for c in kubelet kube-proxy containerd; do
    local pf="$CLUSTER_DIR/pids/$name-$c.pid"
    if [ -f "$pf" ]; then kill -KILL "$(cat "$pf")" 2>/dev/null || true; rm -f "$pf"; fi
  done
  while pids=$(node_cgroup_pids "$name") && [ -n "$pids" ]; do
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
    node_thaw "$name"
    tries=$((tries + 1)); [ $tries -lt 100 ] || { log "warning: processes of $name survive: $pids"; break; }
    sleep 0.1
  done
  node_mntns_down "$name"
  local m
  for m in $(findmnt -rn -o TARGET | grep -E "^($CLUSTER_VAR|$CLUSTER_RUN)/$name(/|$)" | sort -r); do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || log "warning: cannot unmount $m"
  done
  local veth=""
  if node_exists "$name"; then
    ip route del "$POD_NET_PREFIX.$(node_index "$name").0/24" 2>/dev/null || true
    veth="$VETH_PREFIX$(node_index "$name")"
  fi
  ip netns del "$NETNS_PREFIX$name" 2>/dev/null || true
  # the kernel tears the namespace down later: its index is free once the veth is gone
  if [ -n "$veth" ]; then
    ip link del "$veth" 2>/dev/null || true
    wait_for "$veth of $name to go" 30 veth_gone "$veth"
  fi
  node_cgroups_down "$name"
  rm -rf "${CLUSTER_VAR:?}/$name" "${CLUSTER_RUN:?}/$name" "$(node_dir "$name")"
  pki_node_forget "$name"
}
