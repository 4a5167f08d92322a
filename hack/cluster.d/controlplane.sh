# Host network (bridge), etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler. Sourced by hack/cluster.
# shellcheck shell=bash

HOST_SYSCTLS="net.ipv4.ip_forward vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops kernel.keys.root_maxkeys kernel.keys.root_maxbytes"

net_up() {
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge
    ip addr add "$BRIDGE_IP/24" dev "$BRIDGE"
  fi
  # A fixed MAC: a bridge with a random one takes its lowest port's MAC and changes it
  # whenever a node (veth) joins or leaves, leaving the nodes' ARP entries for the host
  # side stale; packets to 10.213.0.1 (API server, MinIO, the tick ledger) were dropped.
  [ "$(cat "/sys/class/net/$BRIDGE/addr_assign_type")" = 3 ] ||
    ip link set "$BRIDGE" address "$BRIDGE_MAC"
  ip link set "$BRIDGE" up
  mkdir -p "$CLUSTER_DIR"
  # host-wide knobs we (ip_forward) or the kubelets (kernel tunables) change;
  # saved once, restored by `down`
  [ -f "$CLUSTER_DIR/sysctl.orig" ] || sysctl $HOST_SYSCTLS >"$CLUSTER_DIR/sysctl.orig"
  sysctl -qw net.ipv4.ip_forward=1
  sysctl -qw "net.ipv4.conf.$BRIDGE.send_redirects=0"
  modprobe br_netfilter 2>/dev/null || true
}

net_down() {
  ip link del "$BRIDGE" 2>/dev/null || true
  # A node's host-side veth goes with its netns, unless something still pinned that
  # netns when the node was killed: remove the strays by name.
  local link
  for link in $(ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E "^$VETH_PREFIX[0-9]+$"); do
    ip link del "$link" 2>/dev/null || true
  done
  if [ -f "$CLUSTER_DIR/sysctl.orig" ]; then
    sysctl -q -p "$CLUSTER_DIR/sysctl.orig" >/dev/null
    rm -f "$CLUSTER_DIR/sysctl.orig"
  fi
}

apiserver_ready() {
  curl -sf --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" \
    "$APISERVER_URL/readyz" >/dev/null
}

# apiserver_up: starts kube-apiserver (a no-op when it runs) and waits for /readyz.
# --enable-aggregator-routing: the API server calls a webhook's Service (the SIG Sandbox
# pod webhook, docs/agent-sandbox.md) at its endpoints' pod IPs, which the host routes to
# the nodes; ClusterIPs exist only inside the nodes (their kube-proxy).
apiserver_up() {
  local logs="$CLUSTER_DIR/logs"
  start_daemon kube-apiserver "$logs/kube-apiserver.log" "$HERMIT_BIN/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$ETCD_CLIENT_PORT" \
    --bind-address "$BRIDGE_IP" --advertise-address "$BRIDGE_IP" --secure-port "$APISERVER_PORT" \
    --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" \
    --client-ca-file "$PKI/ca.crt" \
    --kubelet-client-certificate "$PKI/apiserver-kubelet-client.crt" \
    --kubelet-client-key "$PKI/apiserver-kubelet-client.key" \
    --kubelet-preferred-address-types InternalIP \
    --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-cluster-ip-range "$SERVICE_CIDR" \
    --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
    --enable-aggregator-routing=true \
    --allow-privileged=true --profiling=false --v=1
  wait_for "kube-apiserver /readyz" 90 apiserver_ready
}

# apiserver_restart: stops kube-apiserver (SIGTERM, its graceful shutdown) and starts it
# again; etcd, the nodes and their pods keep running (a control-plane upgrade or crash).
apiserver_restart() {
  stop_daemon kube-apiserver
  apiserver_up
}

control_plane_up() {
  net_up
  pki_control_plane
  local logs="$CLUSTER_DIR/logs"
  mkdir -p "$CLUSTER_VAR/etcd" "$logs"
  start_daemon etcd "$logs/etcd.log" "$HERMIT_BIN/etcd" --name hermit \
    --data-dir "$CLUSTER_VAR/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_CLIENT_PORT" \
    --advertise-client-urls "http://127.0.0.1:$ETCD_CLIENT_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "hermit=http://127.0.0.1:$ETCD_PEER_PORT" \
    --listen-metrics-urls "" --quota-backend-bytes 2147483648 \
    --unsafe-no-fsync --log-level warn
  wait_for "etcd" 30 curl -sf "http://127.0.0.1:$ETCD_CLIENT_PORT/health"

  apiserver_up

  start_daemon kube-controller-manager "$logs/kube-controller-manager.log" \
    "$HERMIT_BIN/kube-controller-manager" \
    --kubeconfig "$CLUSTER_DIR/controller-manager.kubeconfig" \
    --authentication-kubeconfig "$CLUSTER_DIR/controller-manager.kubeconfig" \
    --authorization-kubeconfig "$CLUSTER_DIR/controller-manager.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$CONTROLLER_MANAGER_PORT" --leader-elect=false \
    --cluster-signing-cert-file "$PKI/ca.crt" --cluster-signing-key-file "$PKI/ca.key" \
    --root-ca-file "$PKI/ca.crt" --service-account-private-key-file "$PKI/sa.key" \
    --use-service-account-credentials=true --controllers '*,bootstrapsigner,tokencleaner' \
    --service-cluster-ip-range "$SERVICE_CIDR" --cluster-cidr "$CLUSTER_CIDR" \
    --allocate-node-cidrs=false --profiling=false --v=1
  start_daemon kube-scheduler "$logs/kube-scheduler.log" "$HERMIT_BIN/kube-scheduler" \
    --kubeconfig "$CLUSTER_DIR/scheduler.kubeconfig" \
    --authentication-kubeconfig "$CLUSTER_DIR/scheduler.kubeconfig" \
    --authorization-kubeconfig "$CLUSTER_DIR/scheduler.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$SCHEDULER_PORT" --leader-elect=false \
    --profiling=false --v=1
}

control_plane_down() {
  local c
  for c in kube-scheduler kube-controller-manager kube-apiserver etcd; do stop_daemon "$c"; done
  rm -rf "$CLUSTER_VAR/etcd"
}
