"""sigpod.py and sigwebhook.review: an opted-in SIG Sandbox's pod as Hermit admits it."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import pytest

from hermit_common import protocol
from hermit_common.errors import SettingsError
from hermit_common.settings import OperatorSettings, SigWebhookSettings
from hermit_operator import podspec, sigpod, sigwebhook
from hermit_operator.podspec import InvalidSpec

SETTINGS = OperatorSettings(init_image="registry.example/hermit:1.0",
                            init_path="/usr/local/bin/hermit-init")
Obj = dict[str, Any]


def sig_pod(*, labels: Obj | None = None, annotations: Obj | None = None,
            container: Obj | None = None, spec: Obj | None = None) -> Obj:
    """A pod as the SIG's controller creates it, after the API server's defaulting and the
    ServiceAccount admission plugin (the token volume), as a webhook sees it."""
    main = {"name": "agent", "image": "example/agent:1", "command": ["python", "agent.py"],
            "args": ["--serve"], "volumeMounts": [
                {"name": "kube-api-access-abcde", "readOnly": True,
                 "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}],
            **(container or {})}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": "box", "namespace": "team-a",
            "labels": {"agents.x-k8s.io/sandbox-name-hash": "1a2b",
                       sigpod.LABEL_OPT_IN: sigpod.OPT_IN_VALUE, **(labels or {})},
            "annotations": dict(annotations or {}),
            "ownerReferences": [{"apiVersion": "agents.x-k8s.io/v1beta1", "kind": "Sandbox",
                                 "name": "box", "uid": "u1", "controller": True,
                                 "blockOwnerDeletion": True}]},
        "spec": {
            "containers": [main], "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 30, "serviceAccountName": "default",
            "volumes": [{"name": "kube-api-access-abcde", "projected": {"sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
                {"configMap": {"name": "kube-root-ca.crt"}}]}}],
            "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists",
                             "effect": "NoExecute", "tolerationSeconds": 300}],
            **(spec or {})}}


def test_an_opted_in_sandbox_pod_runs_under_hermit_init_with_a_workspace() -> None:
    pod = sig_pod()
    assert sigpod.applies_to(pod)
    out = sigpod.mutate(pod, SETTINGS)
    spec, meta = out["spec"], out["metadata"]
    main = spec["containers"][0]
    assert main["command"] == [podspec.INIT_BINARY, "--", "python", "agent.py"]
    assert main["args"] == ["--serve"]
    assert [m["mountPath"] for m in main["volumeMounts"]] == [podspec.INIT_DIR, "/workspace"]
    assert [c["name"] for c in spec["initContainers"]] == [podspec.INIT_CONTAINER]
    assert spec["initContainers"][0]["image"] == "registry.example/hermit:1.0"
    assert [v["name"] for v in spec["volumes"]] == [podspec.INIT_VOLUME,
                                                     podspec.WORKSPACE_VOLUME]
    assert spec["volumes"][1]["emptyDir"] == {"sizeLimit": "1Gi"}
    # No termination hold yet: nothing would checkpoint the pod or cut the sleep short.
    assert spec["terminationGracePeriodSeconds"] == 30
    assert "lifecycle" not in main
    assert spec["automountServiceAccountToken"] is False
    # The restricted profile's defaults, as for an AgentSandbox's pod.
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert main["securityContext"]["capabilities"]["drop"] == ["ALL"]
    # What the SIG's controller owns stays.
    assert spec["restartPolicy"] == "Always"
    assert meta["name"] == "box" and meta["ownerReferences"] == pod["metadata"][
        "ownerReferences"]
    assert "hostname" not in spec and "affinity" not in spec
    assert meta["labels"][sigpod.LABEL_SIG_SANDBOX] == "box"
    assert meta["labels"]["agents.x-k8s.io/sandbox-name-hash"] == "1a2b"
    assert protocol.LABEL_SANDBOX not in meta["labels"]
    assert meta["annotations"][protocol.ANNOTATION_WORKSPACE_PATH] == "/workspace"
    assert protocol.ANNOTATION_HOLD not in meta["annotations"]
    assert pod == sig_pod(), "the input is not changed"


def test_with_the_hold_the_pod_waits_for_its_checkpoint_as_an_agentsandbox_pod_does() -> None:
    out = sigpod.mutate(sig_pod(), SETTINGS, hold=True)
    spec, annotations = out["spec"], out["metadata"]["annotations"]
    # The API server's default grace (30) is taken as unset: Hermit's hold period.
    assert spec["terminationGracePeriodSeconds"] == SETTINGS.termination_grace_seconds
    assert spec["containers"][0]["lifecycle"]["preStop"] == {
        "sleep": {"seconds": SETTINGS.termination_grace_seconds}}
    assert annotations[protocol.ANNOTATION_HOLD] == "true"
    assert annotations[protocol.ANNOTATION_SAFE_TO_EVICT] == "true"
    # A Sandbox that saves nothing on a drain gets no hold.
    quiet = sig_pod(annotations={sigpod.ANNOTATION_CHECKPOINT: '{"onPreemption": false}'})
    assert "lifecycle" not in sigpod.mutate(quiet, SETTINGS, hold=True)["spec"]["containers"][0]


def test_the_settings_annotations_shape_the_pod_as_an_agentsandbox_spec_would() -> None:
    pod = sig_pod(annotations={
        sigpod.ANNOTATION_CHECKPOINT: json.dumps(
            {"onPreemption": False, "intervalSeconds": 300, "retain": 5, "onTurn": True}),
        sigpod.ANNOTATION_WORKSPACE: json.dumps({"size": "5Gi", "mountPath": "/home/agent"}),
        protocol.ANNOTATION_RESTORE_FROM: "forged", protocol.ANNOTATION_HOLD: "true"})
    out = sigpod.mutate(pod, SETTINGS)
    annotations = out["metadata"]["annotations"]
    assert annotations[protocol.ANNOTATION_ON_PREEMPTION] == "false"
    assert protocol.ANNOTATION_HOLD not in annotations  # nothing to save on a drain
    assert protocol.ANNOTATION_RESTORE_FROM not in annotations  # Hermit's to set
    assert annotations[protocol.ANNOTATION_WORKSPACE_PATH] == "/home/agent"
    assert "lifecycle" not in out["spec"]["containers"][0]
    assert out["spec"]["volumes"][-1]["emptyDir"] == {"sizeLimit": "5Gi"}
    assert sigpod.as_agent_sandbox_spec(pod)["checkpoint"] == {
        "onPreemption": False, "intervalSeconds": 300, "retain": 5, "onTurn": True}


def test_a_grace_period_the_template_chose_is_kept() -> None:
    out = sigpod.mutate(sig_pod(spec={"terminationGracePeriodSeconds": 45}), SETTINGS,
                        hold=True)
    assert out["spec"]["terminationGracePeriodSeconds"] == 45


def test_a_template_that_asks_for_the_token_is_judged_by_the_pod_policy() -> None:
    with pytest.raises(InvalidSpec, match=r"automountServiceAccountToken.*default"):
        sigpod.mutate(sig_pod(spec={"automountServiceAccountToken": True}), SETTINGS)


@pytest.mark.parametrize(("pod", "message"), [
    (sig_pod(container={"securityContext": {"privileged": True}}),
     r"spec\.podTemplate\.spec\.containers\[0\]\.securityContext\.privileged: privileged "
     r"containers are not allowed"),
    (sig_pod(spec={"hostNetwork": True}), r"spec\.podTemplate\.spec\.hostNetwork"),
    (sig_pod(container={"command": None}),
     r"spec\.podTemplate\.spec\.containers\[0\]\.command is required: Hermit runs it "
     r"under its init"),
    (sig_pod(spec={"initContainers": [{"name": "hermit-init", "image": "x"}]}),
     r"spec\.podTemplate\.spec\.initContainers: the name 'hermit-init' is reserved"),
    (sig_pod(annotations={sigpod.ANNOTATION_CHECKPOINT: "{not json"}),
     r"annotations\['hermit.dev/checkpoint'\] is not JSON"),
    (sig_pod(annotations={sigpod.ANNOTATION_CHECKPOINT: '{"intervalSeconds": 5}'}),
     r"intervalSeconds must be a whole number of at least 30"),
    (sig_pod(annotations={sigpod.ANNOTATION_CHECKPOINT: '{"interval": "5m"}'}),
     r"unknown field\(s\) interval"),
    (sig_pod(annotations={sigpod.ANNOTATION_CHECKPOINT: '{"onTurn": "yes"}'}),
     r"onTurn must be true or false"),
    (sig_pod(annotations={sigpod.ANNOTATION_CHECKPOINT:
                          '{"storage": {"bucket": "b1b", "endpoint": "https://x"}}'}),
     r"storage\.endpoint needs storage\.secretRef"),
    (sig_pod(annotations={sigpod.ANNOTATION_WORKSPACE: '{"mountPath": "relative"}'}),
     r"mountPath must be an absolute path"),
])
def test_a_pod_hermit_cannot_run_or_the_policy_forbids_is_refused_with_the_field(
        pod: Obj, message: str) -> None:
    with pytest.raises(InvalidSpec, match=message):
        sigpod.mutate(pod, SETTINGS)


def test_only_opted_in_pods_of_a_sig_sandbox_are_changed() -> None:
    assert not sigpod.applies_to(sig_pod(labels={sigpod.LABEL_OPT_IN: "disabled"}))
    bare = sig_pod()
    bare["metadata"]["ownerReferences"] = []
    assert not sigpod.applies_to(bare)
    other = sig_pod()
    other["metadata"]["ownerReferences"][0]["apiVersion"] = "example.com/v1"
    assert not sigpod.applies_to(other)


def test_a_template_may_not_bring_the_labels_of_an_agentsandbox_pod() -> None:
    with pytest.raises(InvalidSpec, match=r"spec\.podTemplate\.metadata\.labels: "
                                          r"hermit\.dev/sandbox is Hermit's own"):
        sigpod.mutate(sig_pod(labels={protocol.LABEL_SANDBOX: "other"}), SETTINGS)


def _review(pod: Obj, operation: str = "CREATE") -> Obj:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "r1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                        "operation": operation, "namespace": "team-a", "object": pod}}


def _apply(pod: Obj, ops: list[Obj]) -> Obj:
    """The JSONPatch ops sigpod.patch makes (add/replace of a member), applied."""
    out = copy.deepcopy(pod)
    for op in ops:
        assert op["op"] in ("add", "replace")
        *parents, last = op["path"].strip("/").split("/")
        target = out
        for part in parents:
            target = target[part]
        target[last] = op["value"]
    return out


def test_the_ca_bundle_patch_sets_only_what_differs() -> None:
    pem = b"-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n"
    bundle = base64.b64encode(pem).decode()
    config = {"webhooks": [{"clientConfig": {"service": {}}},
                           {"clientConfig": {"caBundle": bundle}},
                           {"clientConfig": {"caBundle": "b2xk"}}]}
    assert sigwebhook.ca_bundle_patch(config, pem) == [
        {"op": "add", "path": "/webhooks/0/clientConfig/caBundle", "value": bundle},
        {"op": "add", "path": "/webhooks/2/clientConfig/caBundle", "value": bundle}]
    assert sigwebhook.ca_bundle_patch({"webhooks": [{"clientConfig": {
        "caBundle": bundle}}]}, pem) == []


def test_the_review_patches_an_opted_in_pod_to_the_mutated_one() -> None:
    pod = sig_pod()
    answer = sigwebhook.review(_review(pod), SETTINGS)
    response = answer["response"]
    assert answer["kind"] == "AdmissionReview" and response["uid"] == "r1"
    assert response["allowed"] is True and response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    assert _apply(pod, ops) == sigpod.mutate(pod, SETTINGS)


def test_the_review_refuses_with_a_readable_message() -> None:
    response = sigwebhook.review(_review(sig_pod(spec={"hostPID": True})), SETTINGS)[
        "response"]
    assert response["allowed"] is False
    assert response["status"]["code"] == 403
    assert response["status"]["message"] == (
        "Hermit refuses the pod of Sandbox box: the pod template could escape the sandbox, "
        "which the operator's pod policy refuses: spec.podTemplate.spec.hostPID: host "
        "namespaces are not allowed (allowed by operator.podPolicy.allow: [hostNamespaces])")


@pytest.mark.parametrize("pod", [sig_pod(labels={sigpod.LABEL_OPT_IN: "no"}),
                                 sig_pod(spec={"hostPID": True})])
def test_the_review_lets_other_pods_and_operations_through_untouched(pod: Obj) -> None:
    operation = "CREATE" if not pod["spec"].get("hostPID") else "UPDATE"
    response = sigwebhook.review(_review(pod, operation), SETTINGS)["response"]
    assert response == {"uid": "r1", "allowed": True}


def test_the_server_answers_only_its_path_and_admission_reviews() -> None:
    assert sigwebhook.handle(SETTINGS, "/other", b"{}").status == 404
    assert sigwebhook.handle(SETTINGS, sigwebhook.PATH, b"nope").status == 400
    assert sigwebhook.handle(SETTINGS, sigwebhook.PATH, b'{"kind": "Pod"}').status == 400
    reply = sigwebhook.handle(SETTINGS, sigwebhook.PATH,
                              json.dumps(_review(sig_pod())).encode())
    assert reply.status == 200 and reply.body["response"]["allowed"] is True


def test_the_webhook_settings_name_what_is_missing() -> None:
    assert SigWebhookSettings.from_env({}) == SigWebhookSettings()
    with pytest.raises(SettingsError, match="HERMIT_SIG_WEBHOOK_TLS_CERT_FILE"):
        SigWebhookSettings.from_env({"HERMIT_SIG_WEBHOOK_PORT": "8443"})
    hook = SigWebhookSettings.from_env({"HERMIT_SIG_WEBHOOK_PORT": "8443",
                                        "HERMIT_SIG_WEBHOOK_TLS_CERT_FILE": "/t/tls.crt",
                                        "HERMIT_SIG_WEBHOOK_TLS_KEY_FILE": "/t/tls.key"})
    assert (hook.port, hook.tls_cert_file, hook.tls_key_file) == (
        8443, "/t/tls.crt", "/t/tls.key")
