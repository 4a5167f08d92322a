"""The SIG Sandbox pod webhook (sigwebhook.py) between the SIG's real controller and a real
kube-apiserver (a throwaway control plane, no kubelet): the webhook is served over TLS from
this process, registered as the chart registers it (its objectSelector, failurePolicy Fail),
and the controller creates the pods. An opted-in Sandbox's pod comes out as sigpod.py
makes it; a Sandbox that did not opt in gets its pod as the controller made it; a pod the
pod policy refuses is not created, and the Sandbox's Ready condition says why."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from hermit_common import protocol
from hermit_common.settings import OperatorSettings, SigWebhookSettings
from hermit_operator import podspec, sigpod, sigwebhook
from hermit_testbed.minio import free_port
from tests.support.agent_sandbox import (
    GROUP,
    PLURAL,
    VERSION,
    Sig,
    condition,
    owned_pods,
    sig_controller,
)
from tests.support.controlplane import ControlPlane, control_plane
from tests.support.tls import self_signed
from tests.support.wait import wait_until

__all__ = ["control_plane"]

NS = "sig-hook"
HOOK = "sig-sandbox-pods.hermit.dev"
CONFIGURATION = "hermit-sig-sandbox-pods"
Obj = dict[str, Any]


def _configuration_body(url: str) -> Obj:
    """The MutatingWebhookConfiguration as the chart renders it (no caBundle: the operator
    sets it), with a URL instead of the operator's Service."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": CONFIGURATION},
        "webhooks": [{
            "name": HOOK,
            "clientConfig": {"url": url},
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                       "resources": ["pods"], "scope": "Namespaced"}],
            "objectSelector": {"matchLabels": {sigpod.LABEL_OPT_IN: sigpod.OPT_IN_VALUE}},
            "failurePolicy": "Fail",
            "sideEffects": "None",
            "admissionReviewVersions": ["v1"],
            "reinvocationPolicy": "Never",
            "timeoutSeconds": 10,
        }],
    }


@pytest.fixture(scope="module")
def sig(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[Sig]:
    tls_dir = tmp_path_factory.mktemp("hook-tls")
    cert, key = self_signed(tls_dir, "localhost")
    port = free_port()
    settings = OperatorSettings(
        init_image="registry.example/hermit:1.0",
        sig_webhook=SigWebhookSettings(port=port, tls_cert_file=str(cert),
                                       tls_key_file=str(key)))
    server = sigwebhook.serve(settings, host="127.0.0.1")
    try:
        with sig_controller(control_plane, tmp_path_factory.mktemp("agent-sandbox"),
                            NS) as it:
            admission = client.AdmissionregistrationV1Api(it.api_client)
            admission.create_mutating_webhook_configuration(_configuration_body(
                f"https://127.0.0.1:{port}{sigwebhook.PATH}"))
            # The operator's thread that sets the caBundle from the CA file (main.py).
            stop = threading.Event()
            keeper = threading.Thread(target=sigwebhook.keep_ca_bundle, args=(
                admission, CONFIGURATION, str(cert), stop, 0.5), daemon=True)
            keeper.start()
            try:
                def bundle() -> str | None:
                    config = json.loads(admission.read_mutating_webhook_configuration(
                        CONFIGURATION, _preload_content=False).data)
                    found: str | None = config["webhooks"][0]["clientConfig"].get("caBundle")
                    return found

                injected = wait_until("the caBundle set by keep_ca_bundle", 30, bundle, 0.2)
                assert base64.b64decode(injected) == Path(cert).read_bytes()
                yield it
            finally:
                stop.set()
                keeper.join(10)
                admission.delete_mutating_webhook_configuration(CONFIGURATION)
    finally:
        server.shutdown()
        server.server_close()


def _sandbox(sig: Sig, name: str, *, opt_in: bool, container: Obj | None = None,
             annotations: Obj | None = None) -> str:
    meta: Obj = {"labels": {"app": name}}
    if opt_in:
        meta["labels"][sigpod.LABEL_OPT_IN] = sigpod.OPT_IN_VALUE
    if annotations:
        meta["annotations"] = annotations
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Sandbox", "metadata": {"name": name},
            "spec": {"podTemplate": {"metadata": meta, "spec": {"containers": [
                {"name": "agent", "image": "hermit.local/sandbox:v1",
                 "command": ["sleep", "3600"], **(container or {})}]}}}}
    created: Any = sig.custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, body)
    uid: str = created["metadata"]["uid"]
    return uid


def _one_pod(sig: Sig, uid: str) -> Obj:
    pods = wait_until("the Sandbox's pod", 60, lambda: owned_pods(sig, uid) or None, 0.2)
    assert len(pods) == 1, pods
    return pods[0]


def test_an_opted_in_sandbox_gets_its_pod_under_hermit_init(sig: Sig) -> None:
    uid = _sandbox(sig, "saved", opt_in=True, annotations={
        sigpod.ANNOTATION_CHECKPOINT: json.dumps({"intervalSeconds": 600, "retain": 2}),
        sigpod.ANNOTATION_WORKSPACE: json.dumps({"size": "2Gi", "mountPath": "/work"})})
    pod = _one_pod(sig, uid)
    meta, spec = pod["metadata"], pod["spec"]
    main = spec["containers"][0]
    assert main["command"] == [podspec.INIT_BINARY, "--", "sleep", "3600"], main
    assert {"name": podspec.INIT_VOLUME, "mountPath": podspec.INIT_DIR,
            "readOnly": True} in main["volumeMounts"]
    assert {"name": podspec.WORKSPACE_VOLUME, "mountPath": "/work"} in main["volumeMounts"]
    assert [c["name"] for c in spec["initContainers"]] == [podspec.INIT_CONTAINER]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[podspec.WORKSPACE_VOLUME]["emptyDir"] == {"sizeLimit": "2Gi"}
    # The API server's token volume went with Hermit's automountServiceAccountToken: false.
    assert not [n for n in volumes if n.startswith(sigpod.TOKEN_VOLUME_PREFIX)], volumes
    assert spec["automountServiceAccountToken"] is False
    # No termination hold until Hermit checkpoints Sandbox pods (sigpod.mutate).
    assert spec["terminationGracePeriodSeconds"] == 30
    assert "lifecycle" not in main
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert meta["labels"][sigpod.LABEL_SIG_SANDBOX] == "saved"
    assert meta["annotations"][protocol.ANNOTATION_WORKSPACE_PATH] == "/work"
    assert protocol.ANNOTATION_HOLD not in meta["annotations"]
    # The SIG controller's own labels, name and ownership are kept.
    assert meta["labels"]["agents.x-k8s.io/sandbox-name-hash"], meta["labels"]
    assert meta["name"] == "saved"
    assert [r["kind"] for r in meta["ownerReferences"]] == ["Sandbox"]


def test_a_sandbox_that_did_not_opt_in_gets_its_pod_untouched(sig: Sig) -> None:
    uid = _sandbox(sig, "plain", opt_in=False)
    pod = _one_pod(sig, uid)
    main = pod["spec"]["containers"][0]
    assert main["command"] == ["sleep", "3600"]
    assert not pod["spec"].get("initContainers")
    assert "lifecycle" not in main
    assert not [k for k in {**pod["metadata"].get("labels", {}),
                            **(pod["metadata"].get("annotations") or {})}
                if k.startswith("hermit.dev/")], pod["metadata"]


def test_a_pod_the_policy_refuses_is_not_created_and_the_sandbox_says_why(sig: Sig) -> None:
    uid = _sandbox(sig, "escape", opt_in=True,
                   container={"securityContext": {"privileged": True}})
    expected = ("Hermit refuses the pod of Sandbox escape: the pod template could escape the "
                "sandbox, which the operator's pod policy refuses: "
                "spec.podTemplate.spec.containers[0].securityContext.privileged: "
                "privileged containers are not allowed")

    def refused() -> Obj | None:
        ready = condition(sig, "escape", "Ready")
        return ready if ready and expected in (ready.get("message") or "") else None

    ready = wait_until("the Ready condition naming the refusal", 60, refused, 0.2)
    assert ready["status"] == "False" and ready["reason"] == "ReconcilerError", ready
    assert f'admission webhook "{HOOK}" denied the request' in ready["message"], ready
    assert owned_pods(sig, uid) == []
    assert expected in sig.log.read_text(errors="replace")

    # The same pod created by hand is refused with the same words.
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "by-hand", "labels": {sigpod.LABEL_OPT_IN: sigpod.OPT_IN_VALUE},
        "ownerReferences": [{"apiVersion": f"{GROUP}/{VERSION}", "kind": "Sandbox",
                             "name": "escape", "uid": uid, "controller": True}]},
        "spec": {"containers": [{"name": "agent", "image": "x", "command": ["sh"],
                                 "securityContext": {"privileged": True}}]}}
    with pytest.raises(ApiException) as refusal:
        sig.core.create_namespaced_pod(NS, pod)
    assert refusal.value.status == 403
    assert expected in json.loads(refusal.value.body)["message"]
