# The cluster's image registry (sourced by hack/cluster): the CNCF Distribution registry
# (hack/install-registry) as a host process on the bridge, over plain HTTP with anonymous
# pulls, its storage under $CLUSTER_VAR (gone with `down`). Every node's containerd pulls
# from it over HTTP (node_registry_hosts). `hack/cluster registry` starts it (idempotent),
# pushes the chart's images with hack/push-images, as a team pushes to its own registry,
# and prints the helm --set flags that install them by digest (docs/cluster.md#registry).
# shellcheck shell=bash
REGISTRY_NAME=registry
REGISTRY_HOST=$BRIDGE_IP:$REGISTRY_PORT

registry_up() {
  pid_alive "$CLUSTER_DIR/pids/kube-apiserver.pid" || die "cluster is down: run hack/cluster up"
  [ -x "$HERMIT_BIN/registry" ] || "$HERMIT_ROOT/hack/install-registry" >&2
  local dir=$CLUSTER_DIR/registry
  mkdir -p "$dir" "$CLUSTER_VAR/registry" "$CLUSTER_DIR/logs"
  cat >"$dir/config.yml" <<YAML
version: 0.1
log: {level: warn}
storage: {filesystem: {rootdirectory: $CLUSTER_VAR/registry}}
http: {addr: "$REGISTRY_HOST"}
YAML
  start_daemon "$REGISTRY_NAME" "$CLUSTER_DIR/logs/registry.log" \
    "$HERMIT_BIN/registry" serve "$dir/config.yml"
  wait_for "the registry on $REGISTRY_HOST" 30 curl -sf "http://$REGISTRY_HOST/v2/"
  # stdout: the helm flags; what push-images logs goes to stderr
  "$HERMIT_ROOT/hack/push-images" "$REGISTRY_HOST/hermit" -- --dest-tls-verify=false \
    | tee "$dir/helm-set"
}

registry_down() { stop_daemon "$REGISTRY_NAME"; }

registry_status() {
  if pid_alive "$CLUSTER_DIR/pids/$REGISTRY_NAME.pid"; then echo "http://$REGISTRY_HOST"
  else echo "not running (hack/cluster registry)"; fi
}

# node_registry_hosts: the hosts.toml that lets a node's containerd pull from the registry
# over HTTP (in the CRI's config_path, certs.d/<host:port>/).
node_registry_hosts() {
  cat <<TOML
server = "http://$REGISTRY_HOST"

[host."http://$REGISTRY_HOST"]
  capabilities = ["pull", "resolve"]
TOML
}
