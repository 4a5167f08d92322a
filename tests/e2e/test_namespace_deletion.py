"""A namespace deleted with its sandboxes running: they go with it at once, not after the
termination hold's grace period (docs/protocol.md, Evictions).

The namespace controller deletes the pods long before the AgentSandboxes. A held pod
then waits for a stopping checkpoint that can never be created there; the operator, whose
replacement pod the API server refuses with the cause NamespaceTerminating, removes it."""

from __future__ import annotations

import time
import uuid

import pytest

from hermit_common import protocol
from tests.e2e import sandboxes as sb
from tests.e2e.cluster import E2EConfig, Kube, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def test_a_deleted_namespace_takes_its_held_sandbox_pods_at_once(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig,
) -> None:
    name = f"agent-{uuid.uuid4().hex[:6]}"
    sb.create_sandbox(namespace, name, sb.stateful_spec(e2e_config.sandbox_image))
    where = sb.wait_running(kube, namespace, name, min_ticks=3)
    pod = kube.pod(namespace, where.pod) or {}
    grace = int(pod["spec"]["terminationGracePeriodSeconds"])
    annotations = pod["metadata"].get("annotations") or {}
    assert annotations.get(protocol.ANNOTATION_HOLD) == "true", annotations
    assert grace >= 60, f"the hold's grace period is {grace} s: too short to tell"
    started = time.monotonic()
    kube.api.delete_namespace(namespace)
    wait_until(f"the pods of {namespace} gone", grace,
               lambda: not kube.api.list_namespaced_pod(namespace).items, 0.5)
    took = sb.since(started)
    # Before: the held pod slept out its whole grace period, its tree running.
    assert took < grace / 2, f"the pods of {namespace} took {took} s to go (grace {grace} s)"
    print(f"namespace deleted with a running sandbox (hold grace {grace} s): its pods "
          f"gone in {took} s")
