"""The Kubernetes SIG's agent-sandbox controller (hack/install-agent-sandbox) against a real
kube-apiserver (a throwaway control plane, no kubelet): its CRDs apply with kubectl as
`hack/cluster agent-sandbox` applies them, it starts with the same flags and logs the line
that command waits for, and it drives a Sandbox's pod: created, deleted on
``operatingMode: Suspended``, created anew on ``Running``. The e2e test
(tests/e2e/test_agent_sandbox.py) shows the pod running on real nodes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

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
from tests.support.wait import wait_until

__all__ = ["control_plane"]

NS = "sig"


@pytest.fixture(scope="module")
def sig(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[Sig]:
    with sig_controller(control_plane, tmp_path_factory.mktemp("agent-sandbox"), NS) as it:
        yield it


def _owned_pods(sig: Sig, uid: str) -> list[dict[str, Any]]:
    return owned_pods(sig, uid)


def _condition(sig: Sig, name: str, kind: str) -> dict[str, Any] | None:
    return condition(sig, name, kind)


def test_the_controller_logs_what_hack_cluster_waits_for(sig: Sig) -> None:
    # hack/cluster.d/agent-sandbox.sh agent_sandbox_workers_started greps these.
    def started() -> bool:
        return any('"Starting workers"' in line and '"controller":"sandbox"' in line
                   for line in sig.log.read_text(errors="replace").splitlines())

    wait_until(f"the Sandbox controller's workers in {sig.log}", 60, started, 0.2)


def test_a_sandbox_pod_goes_on_suspend_and_a_new_one_comes_on_resume(sig: Sig) -> None:
    name = "smoke"
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Sandbox", "metadata": {"name": name},
            "spec": {"podTemplate": {"spec": {"containers": [
                {"name": "agent", "image": "hermit.local/sandbox:v1",
                 "command": ["sleep", "3600"]}]}}}}
    created: Any = sig.custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, body)
    uid: str = created["metadata"]["uid"]
    assert created["spec"]["operatingMode"] == "Running", created["spec"]

    first = wait_until("the Sandbox's pod", 60, lambda: _owned_pods(sig, uid) or None, 0.2)
    assert [p["metadata"]["name"] for p in first] == [name]
    # No kubelet: the pod stays Pending and the Sandbox not Ready.
    ready = wait_until("a Ready condition", 30, lambda: _condition(sig, name, "Ready"), 0.2)
    assert ready["status"] == "False", ready

    sig.custom.patch_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name,
                                              {"spec": {"operatingMode": "Suspended"}})

    def suspended() -> bool:
        cond = _condition(sig, name, "Suspended")
        return not _owned_pods(sig, uid) and cond is not None and cond["status"] == "True"

    wait_until("the pod gone and Suspended=True", 60, suspended, 0.2)
    ready = _condition(sig, name, "Ready")
    assert ready is not None and ready["reason"] == "SandboxSuspended", ready

    sig.custom.patch_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name,
                                              {"spec": {"operatingMode": "Running"}})
    second = wait_until("a new pod", 60, lambda: _owned_pods(sig, uid) or None, 0.2)
    assert len(second) == 1
    assert second[0]["metadata"]["uid"] != first[0]["metadata"]["uid"]
    # The controller writes the condition after it created the pod: waited for, not read
    # at once (a read right after the pod appeared still saw True).
    wait_until("Suspended=False", 30, lambda: (
        (cond := _condition(sig, name, "Suspended")) is not None and cond["status"] == "False"),
        0.2)
