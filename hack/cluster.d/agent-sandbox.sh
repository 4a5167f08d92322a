# The Kubernetes SIG's agent-sandbox controller (sigs.k8s.io/agent-sandbox, the `Sandbox`
# API of agents.x-k8s.io) as one more host process of the control plane, opt-in:
# `hack/cluster agent-sandbox`. Built by hack/install-agent-sandbox; docs/agent-sandbox.md.
# Sourced by hack/cluster.
# shellcheck shell=bash

# Host ports of its metrics and probe servers (its defaults, :8080/:8081 on every
# address, would collide with test servers); nothing else of the cluster uses them.
AGENT_SANDBOX_METRICS_ADDR=127.0.0.1:$((18480 + 10 * INSTANCE))
AGENT_SANDBOX_PROBE_ADDR=127.0.0.1:$((18481 + 10 * INSTANCE))
AGENT_SANDBOX_NAME=agent-sandbox-controller
AGENT_SANDBOX_LOG="$CLUSTER_DIR/logs/$AGENT_SANDBOX_NAME.log"

agent_sandbox_ready() {
  curl -sf "http://$AGENT_SANDBOX_PROBE_ADDR/readyz" >/dev/null
}

# agent_sandbox_workers_started FROM_LINE: the Sandbox controller's workers run (its
# caches synced), as logged after line FROM_LINE of its log (earlier runs append too).
agent_sandbox_workers_started() {
  tail -n "+$(($1 + 1))" "$AGENT_SANDBOX_LOG" 2>/dev/null \
    | grep '"Starting workers"' | grep -q '"controller":"sandbox"'
}

# agent_sandbox_up: applies the module's CRDs (all four: Sandbox and the extensions'
# SandboxClaim/SandboxTemplate/SandboxWarmPool) and starts the controller with the admin
# kubeconfig; a no-op when it runs. Waits until its Sandbox workers run.
agent_sandbox_up() {
  pid_alive "$CLUSTER_DIR/pids/kube-apiserver.pid" || die "cluster is down: run hack/cluster up"
  local crds
  crds=$("$HERMIT_ROOT/hack/install-agent-sandbox" crds) \
    || die "hack/install-agent-sandbox failed: the agent-sandbox controller is not built"
  # Server-side: the CRDs are too large for client-side apply's last-applied annotation.
  kctl apply --server-side --force-conflicts -f "$crds" >/dev/null \
    || die "applying the agent-sandbox CRDs in $crds failed"
  kctl wait --for condition=Established --timeout 60s -f "$crds" >/dev/null \
    || die "the agent-sandbox CRDs in $crds are not Established"
  if pid_alive "$CLUSTER_DIR/pids/$AGENT_SANDBOX_NAME.pid"; then
    wait_for "$AGENT_SANDBOX_NAME /readyz" 30 agent_sandbox_ready
    log "$AGENT_SANDBOX_NAME already runs (log: $AGENT_SANDBOX_LOG)"
    return 0
  fi
  mkdir -p "$(dirname "$AGENT_SANDBOX_LOG")"
  touch "$AGENT_SANDBOX_LOG"
  local from; from=$(wc -l <"$AGENT_SANDBOX_LOG")
  # --leader-elect=false: one replica, as the rest of this control plane.
  # --extensions: SandboxClaim, SandboxTemplate and SandboxWarmPool are only served
  # (their controllers run) with it.
  start_daemon "$AGENT_SANDBOX_NAME" "$AGENT_SANDBOX_LOG" "$HERMIT_BIN/$AGENT_SANDBOX_NAME" \
    --kubeconfig "$KUBECONFIG_ADMIN" \
    --leader-elect=false --extensions=true \
    --metrics-bind-address "$AGENT_SANDBOX_METRICS_ADDR" \
    --health-probe-bind-address "$AGENT_SANDBOX_PROBE_ADDR"
  wait_for "$AGENT_SANDBOX_NAME /readyz (log: $AGENT_SANDBOX_LOG)" 60 agent_sandbox_ready
  wait_for "$AGENT_SANDBOX_NAME Sandbox workers (log: $AGENT_SANDBOX_LOG)" 60 \
    agent_sandbox_workers_started "$from"
  log "$AGENT_SANDBOX_NAME up: metrics http://$AGENT_SANDBOX_METRICS_ADDR/metrics, log $AGENT_SANDBOX_LOG"
}

# agent_sandbox_down: stops the controller; its CRDs and Sandboxes stay (etcd goes with
# `hack/cluster down`).
agent_sandbox_down() {
  stop_daemon "$AGENT_SANDBOX_NAME"
}

agent_sandbox_status() {
  if pid_alive "$CLUSTER_DIR/pids/$AGENT_SANDBOX_NAME.pid"; then
    echo "running (pid $(cat "$CLUSTER_DIR/pids/$AGENT_SANDBOX_NAME.pid"), log $AGENT_SANDBOX_LOG)"
  else
    echo "not started (hack/cluster agent-sandbox)"
  fi
}
