"""The sandbox pod policy: templates that would escape the sandbox are refused, by default."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from hermit_common import api
from hermit_common.errors import SettingsError
from hermit_common.settings import POD_POLICY_EXEMPTIONS, OperatorSettings, PodPolicySettings
from hermit_operator import podpolicy, podspec, reconcile

STRICT = PodPolicySettings()
BASELINE = PodPolicySettings(profile="baseline")


def template(**pod: Any) -> dict[str, Any]:
    container = {"name": "agent", "image": "busybox", "command": ["sleep", "inf"]}
    container.update(pod.pop("container", {}))
    return {"containers": [container], **pod}


def sandbox(pod_spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": api.API_VERSION, "kind": api.SANDBOX_KIND,
            "metadata": {"name": "box", "namespace": "ns", "uid": "u1", "generation": 1},
            "spec": {"podTemplate": {"spec": pod_spec}}}


REFUSED = [
    ("privileged", template(container={"securityContext": {"privileged": True}}),
     "spec.podTemplate.spec.containers[0].securityContext.privileged"),
    ("hostPath", template(volumes=[{"name": "root", "hostPath": {"path": "/"}}]),
     "spec.podTemplate.spec.volumes[0].hostPath"),
    ("hostNamespaces", template(hostPID=True), "spec.podTemplate.spec.hostPID"),
    ("hostNamespaces", template(hostNetwork=True), "spec.podTemplate.spec.hostNetwork"),
    ("hostNamespaces", template(hostIPC=True), "spec.podTemplate.spec.hostIPC"),
    ("nodeName", template(nodeName="spot-1"), "spec.podTemplate.spec.nodeName"),
    ("hostPorts", template(container={"ports": [{"containerPort": 80, "hostPort": 80}]}),
     "spec.podTemplate.spec.containers[0].ports[0].hostPort"),
    ("procMount", template(container={"securityContext": {"procMount": "Unmasked"}}),
     "spec.podTemplate.spec.containers[0].securityContext.procMount"),
    ("unconfinedProfiles", template(securityContext={"seccompProfile": {"type": "Unconfined"}}),
     "spec.podTemplate.spec.securityContext.seccompProfile.type"),
    ("unconfinedProfiles", template(container={"securityContext": {
        "appArmorProfile": {"type": "Unconfined"}}}),
     "spec.podTemplate.spec.containers[0].securityContext.appArmorProfile.type"),
    ("unsafeSysctls", template(securityContext={"sysctls": [
        {"name": "kernel.msgmax", "value": "1"}]}),
     "spec.podTemplate.spec.securityContext.sysctls[0]"),
]


@pytest.mark.parametrize(("exemption", "pod_spec", "path"), REFUSED)
def test_a_template_that_escapes_is_refused_and_the_message_names_the_field(
        exemption: str, pod_spec: dict[str, Any], path: str) -> None:
    problems = podpolicy.violations(pod_spec, STRICT)
    assert len(problems) == 1
    assert problems[0].startswith(f"{path}: ")
    assert f"operator.podPolicy.allow: [{exemption}]" in problems[0]


@pytest.mark.parametrize(("exemption", "pod_spec", "path"), REFUSED)
def test_an_admin_can_grant_each_exemption(exemption: str, pod_spec: dict[str, Any],
                                           path: str) -> None:
    assert podpolicy.violations(pod_spec, PodPolicySettings(allow=frozenset({exemption}))) == []


def test_init_and_ephemeral_containers_are_checked_too() -> None:
    pod_spec = template(
        initContainers=[{"name": "i", "image": "x", "securityContext": {"privileged": True}}],
        ephemeralContainers=[{"name": "e", "image": "x",
                              "securityContext": {"privileged": True}}])
    paths = [p.split(":")[0] for p in podpolicy.violations(pod_spec, STRICT)]
    assert paths == ["spec.podTemplate.spec.initContainers[0].securityContext.privileged",
                     "spec.podTemplate.spec.ephemeralContainers[0].securityContext.privileged"]


def test_baseline_capabilities_pass_and_others_need_naming() -> None:
    caps = {"securityContext": {"capabilities": {"add": ["NET_BIND_SERVICE", "CAP_CHOWN",
                                                          "SYS_ADMIN", "sys_ptrace"]}}}
    pod_spec = template(container=caps)
    [problem] = podpolicy.violations(pod_spec, BASELINE)
    assert "capabilities SYS_ADMIN, SYS_PTRACE are beyond the allowed set" in problem
    assert "operator.podPolicy.extraCapabilities" in problem
    looser = PodPolicySettings(profile="baseline",
                               extra_capabilities=frozenset({"SYS_ADMIN", "SYS_PTRACE"}))
    assert podpolicy.violations(pod_spec, looser) == []


def test_restricted_lets_a_container_add_only_net_bind_service() -> None:
    caps = {"securityContext": {"capabilities": {"add": ["NET_BIND_SERVICE", "CAP_CHOWN",
                                                          "SYS_ADMIN"]}}}
    pod_spec = template(container=caps)
    [problem] = podpolicy.violations(pod_spec, STRICT)
    assert problem == (
        "spec.podTemplate.spec.containers[0].securityContext.capabilities.add: capabilities "
        "CHOWN, SYS_ADMIN are beyond the allowed set of the restricted profile (allowed by "
        "operator.podPolicy.extraCapabilities: [CHOWN, SYS_ADMIN])")
    looser = PodPolicySettings(extra_capabilities=frozenset({"CHOWN", "SYS_ADMIN"}))
    assert podpolicy.violations(pod_spec, looser) == []


def test_an_ordinary_template_complies() -> None:
    pod_spec = template(
        volumes=[{"name": "cache", "emptyDir": {}}, {"name": "cfg", "configMap": {"name": "c"}}],
        securityContext={"runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"},
                         "sysctls": [{"name": "net.ipv4.ip_local_port_range",
                                      "value": "1024 65000"}]},
        container={"ports": [{"containerPort": 8080}],
                   "securityContext": {"allowPrivilegeEscalation": False,
                                       "capabilities": {"drop": ["ALL"]}}})
    assert podpolicy.violations(pod_spec, STRICT) == []


def test_every_violation_is_listed_in_one_message() -> None:
    pod_spec = template(hostNetwork=True, volumes=[{"name": "r", "hostPath": {"path": "/"}}],
                        container={"securityContext": {"privileged": True}})
    with pytest.raises(podspec.InvalidSpec) as err:
        podspec.validate(sandbox(pod_spec))
    message = str(err.value)
    assert message.startswith("the pod template could escape the sandbox")
    for field in ("hostNetwork", "volumes[0].hostPath", "securityContext.privileged"):
        assert field in message


def test_the_pod_builder_refuses_too() -> None:
    pod_spec = template(container={"securityContext": {"privileged": True}})
    with pytest.raises(podspec.InvalidSpec):
        podspec.build_sandbox_pod(sandbox(pod_spec), OperatorSettings(), 1, None)


def test_a_refused_sandbox_is_not_accepted_gets_an_event_and_no_pod() -> None:
    pod_spec = template(volumes=[{"name": "root", "hostPath": {"path": "/"}}])
    plan = reconcile.plan(sandbox(pod_spec), None, datetime(2026, 1, 1, tzinfo=UTC),
                          settings=OperatorSettings())
    assert plan.create_pod is None
    assert plan.invalid_spec is not None and "hostPath" in plan.invalid_spec
    accepted = [c for c in plan.status_patch["conditions"] if c["type"] == api.COND_ACCEPTED]
    assert accepted[0]["status"] == "False" and "hostPath" in accepted[0]["message"]
    assert [e.reason for e in plan.events] == [api.REASON_INVALID_SPEC]


def test_an_admin_exemption_lets_the_operator_build_the_pod() -> None:
    pod_spec = template(volumes=[{"name": "root", "hostPath": {"path": "/srv"}}])
    settings = OperatorSettings(pod_policy=PodPolicySettings(allow=frozenset({"hostPath"})))
    plan = reconcile.plan(sandbox(pod_spec), None, datetime(2026, 1, 1, tzinfo=UTC),
                          settings=settings)
    assert plan.invalid_spec is None and plan.create_pod is not None


def test_settings_read_the_policy_and_name_a_wrong_value() -> None:
    policy = OperatorSettings.from_env({"HERMIT_POD_POLICY_ALLOW": "hostPath, nodeName",
                                        "HERMIT_POD_POLICY_CAPABILITIES": "cap_sys_ptrace,"})
    assert policy.pod_policy == PodPolicySettings(allow=frozenset({"hostPath", "nodeName"}),
                                                  extra_capabilities=frozenset({"SYS_PTRACE"}))
    assert OperatorSettings.from_env({}).pod_policy == STRICT
    with pytest.raises(SettingsError, match="HERMIT_POD_POLICY_ALLOW: unknown exemption"):
        OperatorSettings.from_env({"HERMIT_POD_POLICY_ALLOW": "everything"})
    with pytest.raises(SettingsError, match="HERMIT_POD_POLICY_CAPABILITIES"):
        OperatorSettings.from_env({"HERMIT_POD_POLICY_CAPABILITIES": "SYS ADMIN"})


def test_fixing_the_template_starts_the_sandbox() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    bad = sandbox(template(container={"securityContext": {"privileged": True}}))
    refused = reconcile.plan(bad, None, now, settings=OperatorSettings())
    fixed = sandbox(template())
    fixed["metadata"]["generation"] = 2
    fixed["status"] = refused.status_patch
    plan = reconcile.plan(fixed, None, now, settings=OperatorSettings())
    assert plan.invalid_spec is None and plan.create_pod is not None
    accepted = [c for c in plan.status_patch["conditions"] if c["type"] == api.COND_ACCEPTED]
    assert accepted[0]["status"] == "True"


# -- issue 17: no confused deputy ---------------------------------------------------------

def sandbox_in(namespace: str, pod_spec: dict[str, Any], **spec: Any) -> dict[str, Any]:
    obj = sandbox(pod_spec)
    obj["metadata"]["namespace"] = namespace
    obj["spec"].update(spec)
    return obj


def problems_of(obj: dict[str, Any], policy: PodPolicySettings = STRICT) -> list[str]:
    with pytest.raises(podspec.InvalidSpec) as err:
        podspec.validate(obj, policy)
    message = str(err.value)
    assert message.startswith("the pod template could escape the sandbox"), message
    return message.split("refuses: ", 1)[1].split("; ")


SIDECAR = {"name": "spy", "image": "busybox", "command": ["sleep", "inf"]}
ALL_EXEMPT = PodPolicySettings(
    allow=frozenset(POD_POLICY_EXEMPTIONS), profile="baseline", service_accounts=frozenset({"spy"}),
    secret_namespaces=frozenset({"ns"}))


@pytest.mark.parametrize(("pod_spec", "path", "volume"), [
    (template(containers=[{"name": "agent", "image": "x", "command": ["a"]},
                          {**SIDECAR, "volumeMounts": [
                              {"name": "hermit-workspace", "mountPath": "/w"}]}]),
     "spec.podTemplate.spec.containers[1].volumeMounts[0]", "hermit-workspace"),
    (template(initContainers=[{**SIDECAR, "volumeMounts": [
        {"name": "hermit-init", "mountPath": "/i"}]}]),
     "spec.podTemplate.spec.initContainers[0].volumeMounts[0]", "hermit-init"),
    (template(ephemeralContainers=[{**SIDECAR, "volumeMounts": [
        {"name": "hermit-workspace", "mountPath": "/w"}]}]),
     "spec.podTemplate.spec.ephemeralContainers[0].volumeMounts[0]", "hermit-workspace"),
    (template(container={"volumeMounts": [{"name": "hermit-workspace", "mountPath": "/x",
                                           "subPath": "a"}]}),
     "spec.podTemplate.spec.containers[0].volumeMounts[0]", "hermit-workspace"),
])
def test_no_other_container_may_mount_hermits_volumes_and_nothing_exempts_it(
        pod_spec: dict[str, Any], path: str, volume: str) -> None:
    for policy in (STRICT, ALL_EXEMPT):
        [problem] = problems_of(sandbox_in("ns", pod_spec), policy)
        assert problem.startswith(f"{path}: container "), problem
        assert f"mounts Hermit's volume {volume!r}" in problem
        assert problem.endswith("(no exemption: the node-agent copies these volumes while "
                                "only the sandbox's container is frozen)"), problem


@pytest.mark.parametrize("name", ["hermit-workspace", "hermit-init"])
def test_a_template_may_not_define_a_volume_with_a_reserved_name(name: str) -> None:
    pod_spec = template(volumes=[{"name": name, "emptyDir": {}}])
    for policy in (STRICT, ALL_EXEMPT):
        [problem] = problems_of(sandbox_in("ns", pod_spec), policy)
        assert problem.startswith(f"spec.podTemplate.spec.volumes[0].name: the volume name "
                                  f"{name!r} is reserved for Hermit (no exemption"), problem


def test_the_built_pod_mounts_hermits_volumes_only_in_the_sandbox_and_init_container() -> None:
    sidecar = {**SIDECAR, "volumeMounts": [{"name": "c", "mountPath": "/c"}]}
    pod_spec = template(containers=[{"name": "agent", "image": "x", "command": ["a"]}, sidecar],
                        volumes=[{"name": "c", "emptyDir": {}}])
    pod = podspec.build_sandbox_pod(sandbox_in("ns", pod_spec), OperatorSettings(), 1, None)
    mounting = {c["name"] for kind in ("containers", "initContainers")
                for c in pod["spec"][kind] for m in c.get("volumeMounts") or []
                if m["name"] in podpolicy.HERMIT_VOLUMES}
    assert mounting == {"agent", podspec.INIT_CONTAINER}


def test_a_shared_process_namespace_is_refused_with_no_exemption() -> None:
    for policy in (STRICT, ALL_EXEMPT):
        [problem] = problems_of(sandbox_in("ns", template(shareProcessNamespace=True)), policy)
        assert problem.startswith("spec.podTemplate.spec.shareProcessNamespace: ")
        assert problem.endswith("(no exemption: the capture freezes and dumps only the "
                                "sandbox's container)")
    assert podpolicy.violations(template(shareProcessNamespace=False), STRICT) == []


RESTRICTED_ONLY = [
    (template(container={"securityContext": {"allowPrivilegeEscalation": True}}),
     "spec.podTemplate.spec.containers[0].securityContext.allowPrivilegeEscalation"),
    (template(securityContext={"runAsNonRoot": False}),
     "spec.podTemplate.spec.securityContext.runAsNonRoot"),
    (template(container={"securityContext": {"runAsUser": 0}}),
     "spec.podTemplate.spec.containers[0].securityContext.runAsUser"),
    (template(initContainers=[{**SIDECAR, "securityContext": {"runAsUser": 0}}]),
     "spec.podTemplate.spec.initContainers[0].securityContext.runAsUser"),
    (template(volumes=[{"name": "n", "nfs": {"server": "s", "path": "/"}}]),
     "spec.podTemplate.spec.volumes[0].nfs"),
]


@pytest.mark.parametrize(("pod_spec", "path"), RESTRICTED_ONLY)
def test_restricted_refuses_what_it_forbids_and_baseline_allows_it(
        pod_spec: dict[str, Any], path: str) -> None:
    [problem] = problems_of(sandbox_in("ns", pod_spec))
    assert problem.startswith(f"{path}: "), problem
    assert problem.endswith("(allowed by operator.podPolicy.profile: baseline)"), problem
    assert podpolicy.violations(pod_spec, BASELINE, namespace="ns") == []


def test_restricted_allows_its_volume_types() -> None:
    volumes = [{"name": "a", "emptyDir": {}}, {"name": "b", "configMap": {"name": "c"}},
               {"name": "c", "persistentVolumeClaim": {"claimName": "p"}},
               {"name": "d", "downwardAPI": {"items": []}},
               {"name": "e", "ephemeral": {"volumeClaimTemplate": {"spec": {}}}},
               {"name": "f", "csi": {"driver": "d"}},
               {"name": "g", "projected": {"sources": [{"configMap": {"name": "c"}}]}}]
    assert podpolicy.violations(template(volumes=volumes), STRICT, namespace="ns") == []


def built(pod_spec: dict[str, Any], policy: PodPolicySettings = STRICT,
          namespace: str = "ns") -> dict[str, Any]:
    settings = OperatorSettings(pod_policy=policy)
    spec: dict[str, Any] = podspec.build_sandbox_pod(
        sandbox_in(namespace, pod_spec), settings, 1, None)["spec"]
    return spec


def test_the_builder_fills_restricted_defaults_where_the_template_is_silent() -> None:
    spec = built(template())
    assert spec["securityContext"] == {
        "runAsUser": 65532, "runAsGroup": 65532, "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"}}
    assert spec["automountServiceAccountToken"] is False
    for c in [*spec["containers"], *spec["initContainers"]]:
        assert c["securityContext"]["allowPrivilegeEscalation"] is False, c["name"]
        assert "ALL" in c["securityContext"]["capabilities"]["drop"], c["name"]
    # the built pod itself meets the policy, but for the volumes Hermit adds itself
    leftover = podpolicy.violations(spec, STRICT, namespace="ns")
    assert leftover and all("Hermit's volume" in p or "reserved for Hermit" in p
                            for p in leftover), leftover


def test_the_builder_keeps_what_the_template_chose() -> None:
    spec = built(template(
        securityContext={"runAsUser": 1000, "runAsGroup": 100,
                         "seccompProfile": {"type": "Localhost", "localhostProfile": "p"}},
        container={"securityContext": {
            "capabilities": {"add": ["NET_BIND_SERVICE"], "drop": ["NET_RAW"]},
            "allowPrivilegeEscalation": False}}))
    assert spec["securityContext"] == {
        "runAsUser": 1000, "runAsGroup": 100, "runAsNonRoot": True,
        "seccompProfile": {"type": "Localhost", "localhostProfile": "p"}}
    caps = spec["containers"][0]["securityContext"]["capabilities"]
    assert caps == {"add": ["NET_BIND_SERVICE"], "drop": ["NET_RAW", "ALL"]}


def test_a_template_that_names_its_own_user_keeps_the_images_user() -> None:
    """runAsNonRoot alone: the image's (numeric, non-root) USER runs, not 65532."""
    spec = built(template(container={"securityContext": {"runAsNonRoot": True}}))
    assert "runAsUser" not in spec["securityContext"]
    assert spec["securityContext"]["runAsNonRoot"] is True


def test_baseline_adds_no_security_context_but_still_no_token() -> None:
    spec = built(template(), BASELINE)
    assert "securityContext" not in spec
    assert "allowPrivilegeEscalation" not in (
        spec["containers"][0].get("securityContext") or {})
    assert spec["automountServiceAccountToken"] is False


@pytest.mark.parametrize("field", ["serviceAccountName", "serviceAccount"])
def test_another_service_account_is_refused_unless_allow_listed(field: str) -> None:
    pod_spec = template(**{field: "deployer"})
    [problem] = problems_of(sandbox_in("team-a", pod_spec))
    assert problem == (
        f"spec.podTemplate.spec.{field}: the ServiceAccount 'deployer' is not allowed for "
        "sandboxes (allowed by operator.podPolicy.serviceAccounts: [team-a/deployer])")
    for entry in ("deployer", "team-a/deployer"):
        policy = PodPolicySettings(service_accounts=frozenset({entry}))
        assert podpolicy.violations(pod_spec, policy, namespace="team-a") == []
    other = PodPolicySettings(service_accounts=frozenset({"team-b/deployer"}))
    assert podpolicy.violations(pod_spec, other, namespace="team-a") != []


def test_the_default_service_account_is_fine_but_its_token_is_not_mounted() -> None:
    for pod_spec in (template(), template(serviceAccountName="default")):
        assert podpolicy.violations(pod_spec, STRICT, namespace="ns") == []
        assert built(pod_spec)["automountServiceAccountToken"] is False
    assert built(template(automountServiceAccountToken=False))[
        "automountServiceAccountToken"] is False


def test_a_token_is_mounted_only_for_an_allowed_account_that_asks_for_it() -> None:
    wants = template(serviceAccountName="agent", automountServiceAccountToken=True)
    policy = PodPolicySettings(service_accounts=frozenset({"agent"}))
    spec = built(wants, policy)
    assert spec["serviceAccountName"] == "agent" and spec["automountServiceAccountToken"]
    assert built(template(serviceAccountName="agent"), policy)[
        "automountServiceAccountToken"] is False
    [problem] = problems_of(sandbox_in("ns", template(automountServiceAccountToken=True)))
    assert problem == (
        "spec.podTemplate.spec.automountServiceAccountToken: mounting the token of "
        "ServiceAccount 'default' is not allowed (allowed by operator.podPolicy."
        "serviceAccounts: [ns/default])")


SECRETS = [
    (template(volumes=[{"name": "s", "secret": {"secretName": "db"}}]),
     "spec.podTemplate.spec.volumes[0].secret: volume 's' mounts Secret 'db'"),
    (template(volumes=[{"name": "p", "projected": {"sources": [
        {"configMap": {"name": "c"}}, {"secret": {"name": "db"}}]}}]),
     "spec.podTemplate.spec.volumes[0].projected.sources[1].secret: volume 'p' projects "
     "Secret 'db'"),
    (template(volumes=[{"name": "t", "projected": {"sources": [
        {"serviceAccountToken": {"path": "token", "audience": "vault"}}]}}]),
     "spec.podTemplate.spec.volumes[0].projected.sources[0].serviceAccountToken: volume 't' "
     "projects a ServiceAccount token"),
    (template(volumes=[{"name": "v", "csi": {"driver": "d",
                                             "nodePublishSecretRef": {"name": "db"}}}]),
     "spec.podTemplate.spec.volumes[0].csi.nodePublishSecretRef: volume 'v' hands a Secret "
     "to its driver"),
    (template(container={"envFrom": [{"configMapRef": {"name": "c"}},
                                     {"secretRef": {"name": "db"}}]}),
     "spec.podTemplate.spec.containers[0].envFrom[1].secretRef: the environment comes from "
     "Secret 'db'"),
    (template(initContainers=[{**SIDECAR, "env": [{"name": "PW", "valueFrom": {
        "secretKeyRef": {"name": "db", "key": "pw"}}}]}]),
     "spec.podTemplate.spec.initContainers[0].env[0].valueFrom.secretKeyRef: variable 'PW' "
     "comes from Secret 'db'"),
]


@pytest.mark.parametrize(("pod_spec", "problem"), SECRETS)
def test_secrets_are_refused_unless_the_namespace_is_listed(
        pod_spec: dict[str, Any], problem: str) -> None:
    assert problems_of(sandbox_in("team-a", pod_spec)) == [
        f"{problem} (allowed by operator.podPolicy.secretNamespaces: [team-a])"]
    listed = PodPolicySettings(secret_namespaces=frozenset({"team-a"}))
    assert podpolicy.violations(pod_spec, listed, namespace="team-a") == []
    assert podpolicy.violations(pod_spec, listed, namespace="team-b") != []


def test_config_maps_and_plain_env_are_not_secrets() -> None:
    pod_spec = template(volumes=[{"name": "c", "configMap": {"name": "c"}}],
                        container={"envFrom": [{"configMapRef": {"name": "c"}}],
                                   "env": [{"name": "A", "value": "1"}, {
                                       "name": "N", "valueFrom": {"fieldRef": {
                                           "fieldPath": "metadata.name"}}}]})
    assert podpolicy.violations(pod_spec, STRICT, namespace="ns") == []


PLACEMENT = [
    (template(nodeSelector={"karpenter.sh/capacity-type": "on-demand"}), {},
     "spec.podTemplate.spec.nodeSelector: a template nodeSelector switches the spot "
     "requirement off"),
    (template(nodeSelector={"pool": "gpu"}), {},
     "spec.podTemplate.spec.nodeSelector: a template nodeSelector switches the spot "
     "requirement off"),
    (template(affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "zone", "operator": "In", "values": ["a"]},
            {"key": "karpenter.sh/capacity-type", "operator": "In",
             "values": ["on-demand"]}]}]}}}), {},
     "spec.podTemplate.spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuring"
     "Execution.nodeSelectorTerms[0].matchExpressions[1]: requires nodes that are not spot"),
    (template(affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "eks.amazonaws.com/capacityType", "operator": "NotIn",
             "values": ["SPOT"]}]}]}}}), {},
     "spec.podTemplate.spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuring"
     "Execution.nodeSelectorTerms[0].matchExpressions[0]: requires nodes that are not spot"),
    (template(tolerations=[{"key": "node.kubernetes.io/unschedulable",
                            "operator": "Exists", "effect": "NoSchedule"}]), {},
     "spec.podTemplate.spec.tolerations[0]: the toleration effect=NoSchedule, "
     "key=node.kubernetes.io/unschedulable, operator=Exists tolerates the "
     "node.kubernetes.io/unschedulable taint"),
    (template(tolerations=[{"key": "node.kubernetes.io/not-ready", "operator": "Exists"}]),
     {}, "spec.podTemplate.spec.tolerations[0]: the toleration key=node.kubernetes.io/"
     "not-ready, operator=Exists tolerates the node.kubernetes.io/not-ready taint"),
    (template(), {"tolerations": [{"key": "node.kubernetes.io/unreachable",
                                   "operator": "Exists", "effect": "NoExecute"}]},
     "spec.placement.tolerations[0]: the toleration effect=NoExecute, "
     "key=node.kubernetes.io/unreachable, operator=Exists tolerates the "
     "node.kubernetes.io/unreachable taint"),
    (template(tolerations=[{"operator": "Exists", "effect": "NoExecute"}]), {},
     "spec.podTemplate.spec.tolerations[0]: the toleration effect=NoExecute, "
     "operator=Exists tolerates every taint"),
]


@pytest.mark.parametrize(("pod_spec", "placement", "problem"), PLACEMENT)
def test_placement_that_escapes_spot_nodes_is_refused_unless_exempt(
        pod_spec: dict[str, Any], placement: dict[str, Any], problem: str) -> None:
    [found] = problems_of(sandbox_in("ns", pod_spec, placement=placement))
    assert found.startswith(problem), found
    assert found.endswith("(allowed by operator.podPolicy.allow: [placement])"), found
    exempt = PodPolicySettings(allow=frozenset({"placement"}))
    assert podpolicy.violations(pod_spec, exempt, namespace="ns", placement=placement) == []


def test_placement_that_keeps_spot_passes() -> None:
    ok = template(
        affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["spot"]},
                {"key": "zone", "operator": "NotIn", "values": ["b"]}]}]}}},
        tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},
                     # what Kubernetes adds to every pod: the eviction is only delayed
                     {"key": "node.kubernetes.io/not-ready", "operator": "Exists",
                      "effect": "NoExecute", "tolerationSeconds": 300}])
    placement = {"nodeSelector": {"kubernetes.io/hostname": "spot-1"},
                 "tolerations": [{"key": "spot", "operator": "Exists"}]}
    assert podpolicy.violations(ok, STRICT, namespace="ns", placement=placement) == []
    # with spot: false the template's nodeSelector takes nothing off spot nodes
    assert podpolicy.violations(template(nodeSelector={"pool": "gpu"}), STRICT,
                                namespace="ns", placement={"spot": False}) == []


def test_tolerating_the_interruption_taint_has_no_exemption() -> None:
    tol = {"key": "hermit.dev/interruption", "operator": "Exists"}
    for policy in (STRICT, ALL_EXEMPT):
        [problem] = problems_of(sandbox_in("ns", template(tolerations=[tol])), policy)
        assert "tolerates the hermit.dev/interruption taint" in problem
        assert problem.endswith("(no exemption: Hermit moves sandboxes off nodes with this "
                                "taint)")


def test_every_exemption_at_once_still_refuses_only_the_no_exemption_rules() -> None:
    pod_spec = template(
        hostPID=True, shareProcessNamespace=True, serviceAccountName="spy",
        nodeSelector={"pool": "x"}, volumes=[{"name": "s", "secret": {"secretName": "db"}}],
        container={"securityContext": {"privileged": True, "runAsUser": 0}})
    problems = podpolicy.violations(pod_spec, ALL_EXEMPT, namespace="ns")
    assert [p.split(":")[0] for p in problems] == [
        "spec.podTemplate.spec.shareProcessNamespace"]


def test_settings_read_the_new_policy_values_and_name_a_wrong_one() -> None:
    policy = OperatorSettings.from_env({
        "HERMIT_POD_POLICY_PROFILE": "baseline",
        "HERMIT_POD_POLICY_ALLOW": "placement",
        "HERMIT_POD_POLICY_SERVICE_ACCOUNTS": "agent, team-a/deployer",
        "HERMIT_POD_POLICY_SECRET_NAMESPACES": "team-a,team-b"}).pod_policy
    assert policy == PodPolicySettings(
        allow=frozenset({"placement"}), profile="baseline",
        service_accounts=frozenset({"agent", "team-a/deployer"}),
        secret_namespaces=frozenset({"team-a", "team-b"}))
    assert OperatorSettings.from_env({}).pod_policy.profile == "restricted"
    for name, value in (("HERMIT_POD_POLICY_PROFILE", "privileged"),
                        ("HERMIT_POD_POLICY_SERVICE_ACCOUNTS", "Not_A_Name"),
                        ("HERMIT_POD_POLICY_SERVICE_ACCOUNTS", "team-a/x/y"),
                        ("HERMIT_POD_POLICY_SECRET_NAMESPACES", "a.b"),
                        ("HERMIT_POD_POLICY_SECRET_NAMESPACES", "a/b")):
        with pytest.raises(SettingsError, match=name):
            OperatorSettings.from_env({name: value})
