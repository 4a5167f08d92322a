"""The sandbox pod policy: templates that would escape the sandbox are refused, by default."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from hermit_common import api
from hermit_common.errors import SettingsError
from hermit_common.settings import OperatorSettings, PodPolicySettings
from hermit_operator import podpolicy, podspec, reconcile

STRICT = PodPolicySettings()


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
    [problem] = podpolicy.violations(pod_spec, STRICT)
    assert "capabilities SYS_ADMIN, SYS_PTRACE are beyond the allowed set" in problem
    assert "operator.podPolicy.extraCapabilities" in problem
    looser = PodPolicySettings(extra_capabilities=frozenset({"SYS_ADMIN", "SYS_PTRACE"}))
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
