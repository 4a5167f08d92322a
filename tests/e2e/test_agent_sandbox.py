"""The Kubernetes SIG's agent-sandbox (sigs.k8s.io/agent-sandbox: the ``Sandbox`` API of
agents.x-k8s.io) on the e2e cluster, run by its own controller: the baseline Hermit is
to serve (issue 20). Without opting in: a Sandbox gets a Running pod and Ready,
``operatingMode: Suspended`` removes the pod, Running again brings a new one. Opted in
(agentSandbox.webhook on; docs/agent-sandbox.md#opting-a-sandbox-in): the pod runs
under hermit-init, and one the pod policy refuses is not created, the Sandbox saying why.

The controller and its CRDs come from ``HERMIT_E2E_AGENT_SANDBOX_CMD`` (default
``hack/cluster agent-sandbox``; docs/agent-sandbox.md)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from tests.e2e import sandboxes as sb

from .cluster import RELEASE, E2EConfig, Kube, helm_set, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

Obj = dict[str, Any]

# The SIG's API (k8s/crds/agents.x-k8s.io_sandboxes.yaml of v1.0.3 serves v1beta1 only).
GROUP = "agents.x-k8s.io"
VERSION = "v1beta1"
PLURAL = "sandboxes"


@pytest.fixture(scope="session")
def agent_sandbox(kube: Kube, e2e_config: E2EConfig) -> None:
    """The SIG's controller runs and its CRDs are served (the command is idempotent; the
    controller is left running, as the cluster is)."""
    sb.start_agent_sandbox(e2e_config)


def _custom() -> client.CustomObjectsApi:
    return client.CustomObjectsApi()


def _sandbox(ns: str, name: str) -> Obj:
    obj: Any = _custom().get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
    return dict(obj)


def _condition(sandbox: Obj, kind: str) -> Obj | None:
    for cond in (sandbox.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            found: Obj = cond
            return found
    return None


def _set_mode(ns: str, name: str, mode: str) -> int:
    """Sets spec.operatingMode; returns the Sandbox's new generation."""
    obj: Any = _custom().patch_namespaced_custom_object(
        GROUP, VERSION, ns, PLURAL, name, {"spec": {"operatingMode": mode}})
    generation: int = obj["metadata"]["generation"]
    return generation


def _owned_pods(kube: Kube, ns: str, uid: str) -> list[Obj]:
    """The pods whose controller is the Sandbox with this uid (the SIG's controller names
    its pod after the Sandbox; ownership is what it goes by)."""
    pods: list[Obj] = json.loads(
        kube.api.list_namespaced_pod(ns, _preload_content=False).data)["items"]
    return [p for p in pods
            if any(ref.get("controller") and ref.get("uid") == uid
                   for ref in p["metadata"].get("ownerReferences") or [])]


def _wait_ready(kube: Kube, ns: str, name: str, uid: str, timeout: float = 120) -> Obj:
    """Waits for the Sandbox's one pod to be Running and the Sandbox Ready (of its
    current generation); returns the pod."""
    def probe() -> Obj | None:
        sandbox = _sandbox(ns, name)
        ready = _condition(sandbox, "Ready")
        if not ready or ready["status"] != "True" or \
                ready.get("observedGeneration") != sandbox["metadata"]["generation"]:
            return None
        pods = [p for p in _owned_pods(kube, ns, uid)
                if not p["metadata"].get("deletionTimestamp")]
        if len(pods) == 1 and pods[0]["status"].get("phase") == "Running":
            return pods[0]
        return None

    pod: Obj = wait_until(f"Sandbox {ns}/{name} Ready with a Running pod", timeout, probe)
    return pod


def test_sandbox_runs_suspends_and_resumes(kube: Kube, namespace: str, e2e_config: E2EConfig,
                                           agent_sandbox: None) -> None:
    name = "sig-sandbox"
    container = {"name": "agent", "image": e2e_config.sandbox_image,
                 "imagePullPolicy": "IfNotPresent", "command": ["sleep", "3600"]}
    body: Any = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Sandbox",
                 "metadata": {"name": name},
                 "spec": {"podTemplate": {"spec": {"containers": [container],
                                                   "terminationGracePeriodSeconds": 1}}}}
    created: Any = _custom().create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                             body)
    uid: str = created["metadata"]["uid"]
    # The CRD's default: a Sandbox runs unless told otherwise.
    assert created["spec"]["operatingMode"] == "Running", created["spec"]

    first = _wait_ready(kube, namespace, name, uid)
    assert first["spec"]["containers"][0]["image"] == e2e_config.sandbox_image
    assert first["status"]["podIPs"], first["status"]

    generation = _set_mode(namespace, name, "Suspended")

    def suspended() -> Obj | None:
        sandbox = _sandbox(namespace, name)
        cond = _condition(sandbox, "Suspended")
        ready = _condition(sandbox, "Ready")
        if _owned_pods(kube, namespace, uid) or not cond or not ready:
            return None
        if cond.get("observedGeneration") != generation or cond["status"] != "True":
            return None
        return sandbox

    sandbox = wait_until(f"Sandbox {namespace}/{name} suspended, its pod gone", 120, suspended)
    ready = _condition(sandbox, "Ready")
    assert ready is not None and ready["status"] == "False", ready
    assert ready["reason"] == "SandboxSuspended", ready
    assert kube.pod(namespace, first["metadata"]["name"]) is None

    _set_mode(namespace, name, "Running")
    second = _wait_ready(kube, namespace, name, uid)
    assert second["metadata"]["uid"] != first["metadata"]["uid"], "the suspended pod came back"
    suspended_cond = _condition(_sandbox(namespace, name), "Suspended")
    assert suspended_cond is not None and suspended_cond["status"] == "False", suspended_cond


@pytest.fixture
def sig_webhook(hermit_release: str, e2e_config: E2EConfig, agent_sandbox: None
                ) -> Iterator[None]:
    """The release with the SIG Sandbox pod webhook on, its caBundle set by the operator,
    for this test only."""
    helm_set(e2e_config, hermit_release, "agentSandbox.webhook.enabled=true")
    try:
        admission = client.AdmissionregistrationV1Api()
        name = f"{RELEASE}-sig-webhook"

        def injected() -> bool:
            raw: Any = admission.read_mutating_webhook_configuration(
                name, _preload_content=False)
            config = json.loads(raw.data)
            return all(h["clientConfig"].get("caBundle") for h in config["webhooks"])

        wait_until(f"the caBundle of {name} set by the operator", 120, injected)
        yield
    finally:
        helm_set(e2e_config, hermit_release, "agentSandbox.webhook.enabled=false")


def _opted_in(name: str, container: Obj) -> Obj:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Sandbox", "metadata": {"name": name},
            "spec": {"podTemplate": {
                "metadata": {"labels": {"hermit.dev/checkpoint": "enabled"},
                             "annotations": {"hermit.dev/workspace": '{"size": "256Mi"}'}},
                "spec": {"containers": [container]}}}}


def test_an_opted_in_sandbox_runs_under_hermit_init(
        kube: Kube, namespace: str, e2e_config: E2EConfig, sig_webhook: None) -> None:
    name = "sig-opted-in"
    container = {"name": "agent", "image": e2e_config.sandbox_image,
                 "imagePullPolicy": "IfNotPresent", "command": ["sleep", "3600"]}
    created: Any = _custom().create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, _opted_in(name, container))
    pod = _wait_ready(kube, namespace, name, created["metadata"]["uid"])
    main = pod["spec"]["containers"][0]
    assert main["command"] == ["/.hermit/hermit-init", "--", "sleep", "3600"], main
    assert {"name": "hermit-workspace", "mountPath": "/workspace"} in main["volumeMounts"]
    [init] = pod["status"]["initContainerStatuses"]
    assert init["name"] == "hermit-init", init
    # the small init image (only hermit-init), not the node-agent's (issue 21, point 1)
    [init_spec] = pod["spec"]["initContainers"]
    repository = init_spec["image"].split("@")[0]
    if ":" in repository.rsplit("/", 1)[-1]:
        repository = repository.rsplit(":", 1)[0]
    assert repository.endswith("/init"), init_spec
    assert init_spec["command"] == ["/usr/local/bin/hermit-init", "--install",
                                    "/.hermit/hermit-init"], init_spec
    assert init["state"]["terminated"]["exitCode"] == 0, init
    assert pod["metadata"]["labels"]["hermit.dev/sig-sandbox"] == name
    assert pod["metadata"]["annotations"]["hermit.dev/workspace-path"] == "/workspace"


def test_an_opted_in_sandbox_the_policy_refuses_gets_no_pod_and_says_why(
        kube: Kube, namespace: str, e2e_config: E2EConfig, sig_webhook: None) -> None:
    name = "sig-refused"
    container = {"name": "agent", "image": e2e_config.sandbox_image,
                 "imagePullPolicy": "IfNotPresent", "command": ["sleep", "3600"],
                 "securityContext": {"privileged": True}}
    created: Any = _custom().create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, _opted_in(name, container))

    def refused() -> Obj | None:
        ready = _condition(_sandbox(namespace, name), "Ready")
        return ready if ready and "Hermit refuses the pod" in (
            ready.get("message") or "") else None

    ready = wait_until(f"Sandbox {namespace}/{name}'s Ready naming the refusal", 120, refused)
    assert "securityContext.privileged: privileged containers are not allowed" in ready[
        "message"], ready
    assert _owned_pods(kube, namespace, created["metadata"]["uid"]) == []
