"""The operator is not a confused deputy: a pod template that would escape the sandbox is
refused on the cluster with a readable message, an Event and no pod."""

from __future__ import annotations

from typing import Any

import pytest

from hermit_common import api, protocol
from tests.e2e import sandboxes as sb
from tests.e2e.conftest import E2EConfig, Kube, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

Obj = dict[str, Any]


def refused(ns: str, name: str) -> str | None:
    """The Accepted=False message once the operator refused the sandbox."""
    for cond in sb.status(ns, name).get("conditions") or []:
        if cond.get("type") == api.COND_ACCEPTED and cond.get("status") == "False":
            return str(cond.get("message"))
    return None


@pytest.mark.parametrize(("what", "change", "field"), [
    ("privileged", lambda c, p: c.update(securityContext={"privileged": True}),
     "containers[0].securityContext.privileged"),
    ("hostPath", lambda c, p: p.update(volumes=[{"name": "host", "hostPath": {"path": "/"}}]),
     "volumes[0].hostPath"),
])
def test_a_sandbox_that_would_escape_is_refused(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig,
    what: str, change: Any, field: str,
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
    assert f"operator.podPolicy.allow: [{what}]" in message, message
    assert sb.status(namespace, name).get("phase") == "Failed"  # until the spec is fixed
    warnings = wait_until("an InvalidSpec Event", 30, lambda: [
        e for e in sb.events(kube, namespace, name)
        if e["reason"] == api.REASON_INVALID_SPEC] or None)
    assert warnings[0]["type"] == "Warning" and field in warnings[0]["message"]
    pods = kube.api.list_namespaced_pod(
        namespace, label_selector=f"{protocol.LABEL_SANDBOX}={name}").items
    assert pods == [], f"a pod was created for a refused sandbox: {[p.metadata.name for p in pods]}"
