"""The operator is not a confused deputy: a pod template that would escape the sandbox is
refused on the cluster with a readable message, an Event and no pod; a template that asks
for nothing runs under the restricted Pod Security Standard by default."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client
from kubernetes.stream import stream

from hermit_common import api, protocol
from tests.e2e import sandboxes as sb
from tests.e2e.cluster import (
    POD_POLICY_PROFILE,
    RELEASE_NS,
    E2EConfig,
    Kube,
    helm_set,
    wait_until,
)
from tests.support.attacks import REFUSED, Attack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

Obj = dict[str, Any]
NO_VOLUMES = ("no exemption: the node-agent copies these volumes while only the sandbox's "
              "container is frozen")
NO_PID = "no exemption: the capture freezes and dumps only the sandbox's container"


# What each refused template would have given its author (the attack suite's table).
ATTACKS = {
    "privileged": "a privileged sandbox container (root on the node)",
    "hostPath": "a hostPath volume of the node's /",
    "sidecar": "a sidecar mounting hermit-workspace (first step of the symlink race)",
    "sharepid": "shareProcessNamespace (a second container sees the frozen tree)",
    "account": "a pod with another ServiceAccount (confused deputy)",
    "secretvolume": "a Secret volume of the namespace (confused deputy)",
    "envfrom": "an envFrom Secret (confused deputy)",
    "ondemand": "a nodeSelector that escapes spot nodes",
}


def refused(ns: str, name: str) -> str | None:
    """The Accepted=False message once the operator refused the sandbox."""
    for cond in sb.status(ns, name).get("conditions") or []:
        if cond.get("type") == api.COND_ACCEPTED and cond.get("status") == "False":
            return str(cond.get("message"))
    return None


def _sidecar_on_the_workspace(c: Obj, p: Obj) -> None:
    """The symlink race of issue 17 starts here: a second container that sees the
    workspace while only the first one is frozen during a checkpoint."""
    p["containers"].append({"name": "spy", "image": c["image"], "command": ["sleep", "3600"],
                            "volumeMounts": [{"name": "hermit-workspace",
                                              "mountPath": "/spy"}]})


@pytest.mark.attack
@pytest.mark.parametrize(("what", "change", "field", "allows"), [
    ("privileged", lambda c, p: c.update(securityContext={"privileged": True}),
     "containers[0].securityContext.privileged", "operator.podPolicy.allow: [privileged]"),
    ("hostPath", lambda c, p: p.update(volumes=[{"name": "host", "hostPath": {"path": "/"}}]),
     "volumes[0].hostPath", "operator.podPolicy.allow: [hostPath]"),
    ("sidecar", _sidecar_on_the_workspace, "containers[1].volumeMounts[0]", NO_VOLUMES),
    ("sharepid", lambda c, p: p.update(shareProcessNamespace=True), "shareProcessNamespace",
     NO_PID),
    ("account", lambda c, p: p.update(serviceAccountName="deployer"), "serviceAccountName",
     "operator.podPolicy.serviceAccounts: [{ns}/deployer]"),
    ("secretvolume", lambda c, p: p.update(volumes=[{"name": "db", "secret": {
        "secretName": "db"}}]), "volumes[0].secret",
     "operator.podPolicy.secretNamespaces: [{ns}]"),
    ("envfrom", lambda c, p: c.update(envFrom=[{"secretRef": {"name": "db"}}]),
     "containers[0].envFrom[0].secretRef", "operator.podPolicy.secretNamespaces: [{ns}]"),
    ("ondemand", lambda c, p: p.update(nodeSelector={
        "karpenter.sh/capacity-type": "on-demand"}), "nodeSelector",
     "operator.podPolicy.allow: [placement]"),
])
def test_a_sandbox_that_would_escape_is_refused(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig,
    what: str, change: Any, field: str, allows: str, attack: Attack,
) -> None:
    spec = sb.stateful_spec(e2e_config.sandbox_image)
    pod_spec = spec["podTemplate"]["spec"]
    change(pod_spec["containers"][0], pod_spec)
    name = f"escape-{what.lower()}"
    sb.create_sandbox(namespace, name, spec)

    message = wait_until(f"sandbox {name} refused (Accepted=False)", 60,
                         lambda: refused(namespace, name))
    print(f"\n{what}: Accepted=False: {message}")
    assert message.startswith("the pod template could escape the sandbox"), message
    assert f"spec.podTemplate.spec.{field}" in message, message
    assert allows.format(ns=namespace) in message, message
    assert sb.status(namespace, name).get("phase") == "Failed"  # until the spec is fixed
    warnings = wait_until("an InvalidSpec Event", 30, lambda: [
        e for e in sb.events(kube, namespace, name)
        if e["reason"] == api.REASON_INVALID_SPEC] or None)
    assert warnings[0]["type"] == "Warning" and field in warnings[0]["message"]
    pods = kube.api.list_namespaced_pod(
        namespace, label_selector=f"{protocol.LABEL_SANDBOX}={name}").items
    assert pods == [], f"a pod was created for a refused sandbox: {[p.metadata.name for p in pods]}"
    attack.record(f"template: {ATTACKS[what]}", tried=f"an AgentSandbox whose podTemplate sets "
                  f"spec.podTemplate.spec.{field}", outcome=REFUSED,
                  evidence=f"Accepted=False, Warning {api.REASON_INVALID_SPEC}, no pod: "
                           f"{message.split(': ', 1)[-1][:160]}")


def test_a_template_that_asks_for_nothing_runs_restricted(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig,
) -> None:
    """The self-checking workload (its image has no USER: root) runs, ticks and keeps its
    state as the default user 65532, with no token, no privilege escalation, no
    capabilities and the runtime's seccomp profile: what the restricted standard asks.
    (The e2e release uses baseline unless HERMIT_E2E_POD_POLICY_PROFILE says otherwise:
    see tests/e2e/cluster.py; this test takes no checkpoint, which needs CAP_SYS_RESOURCE.)"""
    if POD_POLICY_PROFILE != "restricted":
        helm_set(e2e_config, RELEASE_NS, "operator.podPolicy.profile=restricted")
    try:
        _runs_restricted(kube, namespace, e2e_config)
    finally:
        if POD_POLICY_PROFILE != "restricted":
            helm_set(e2e_config, RELEASE_NS, f"operator.podPolicy.profile={POD_POLICY_PROFILE}")


def _runs_restricted(kube: Kube, namespace: str, e2e_config: E2EConfig) -> None:
    # Kubernetes' own Pod Security Admission checks the pod the operator builds.
    body: Any = {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}}
    kube.api.patch_namespace(namespace, body)
    name, where = sb.start_on_spot(kube, e2e_config, RELEASE_NS, namespace)
    pod = kube.pod(namespace, where.pod) or {}
    spec = pod["spec"]
    assert spec["securityContext"]["runAsUser"] == 65532, spec["securityContext"]
    assert spec["securityContext"]["runAsGroup"] == 65532
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False
    for c in [*spec["containers"], *spec["initContainers"]]:
        assert c["securityContext"]["allowPrivilegeEscalation"] is False, c["name"]
        assert "ALL" in c["securityContext"]["capabilities"]["drop"], c["name"]
    assert not any(m["mountPath"].startswith("/var/run/secrets/kubernetes.io")
                   for m in spec["containers"][0].get("volumeMounts") or [])
    status = str(stream(client.CoreV1Api().connect_get_namespaced_pod_exec, where.pod,
                        namespace, command=["sh", "-c", "id -u; grep -E "
                                            "'^(CapEff|CapBnd|NoNewPrivs|Seccomp):' "
                                            "/proc/1/status"],
                        stderr=True, stdin=False, stdout=True, tty=False))
    print(f"\n{name} on {where.node}: {' '.join(status.split())}")
    fields = dict(line.split(":", 1) for line in status.splitlines()[1:] if ":" in line)
    assert status.split()[0] == "65532", status
    assert int(fields["CapEff"].strip(), 16) == 0 and int(fields["CapBnd"].strip(), 16) == 0
    assert fields["NoNewPrivs"].strip() == "1" and fields["Seccomp"].strip() == "2", status
    assert sb.ask(namespace, where.pod).get("counter"), "the workload does not answer"
