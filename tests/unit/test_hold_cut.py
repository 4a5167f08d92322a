"""A deleted AgentSandbox's held pods go at once: nothing is left to save, so the operator
removes the object (grace 0) instead of leaving the preStop sleep to run out its grace
period (docs/protocol.md, Evictions)."""
from __future__ import annotations

from typing import Any

import pytest

from hermit_common import api, protocol
from hermit_common.kubeapi import KubeNamespaceTerminating
from hermit_common.settings import OperatorSettings
from hermit_operator import driver, podspec
from tests.support.operator_driver import FakeKube, run
from tests.support.operator_driver import sandbox as sandbox  # the fixture, re-exported

SB_UID = "u-1"


def pod(name: str = "minimal-1", *, deleting: bool = True, hold: bool = True,
        grace: int = 120, owner: str | None = SB_UID) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name, "namespace": "ns", "uid": f"uid-{name}",
        "labels": {protocol.LABEL_SANDBOX: "minimal", protocol.LABEL_INCARNATION: "1"},
        "annotations": {protocol.ANNOTATION_HOLD: "true"} if hold else {},
        "ownerReferences": [] if owner is None else [
            {"kind": api.SANDBOX_KIND, "name": "minimal", "uid": owner, "controller": True,
             "apiVersion": f"{api.GROUP}/{api.VERSION}"}]}
    if deleting:
        meta.update(deletionTimestamp="2026-01-01T12:00:00Z", deletionGracePeriodSeconds=grace)
    return {"metadata": meta, "spec": {}, "status": {"phase": "Running"}}


def box(*, deleting: bool = False, uid: str = SB_UID) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "minimal", "namespace": "ns", "uid": uid}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T12:00:00Z"
    return {"metadata": meta}


@pytest.mark.parametrize(("the_pod", "the_sandbox", "cut"), [
    (pod(), None, True),  # its AgentSandbox is gone
    (pod(), box(deleting=True), True),  # being deleted (foreground, or a finalizer)
    (pod(), box(uid="another"), True),  # a new one of the same name: not its owner
    (pod(), box(), False),  # its AgentSandbox lives: the node-agent saves it first
    (pod(deleting=False), None, False),  # not being deleted: never started here
    (pod(hold=False), None, False),  # no hold to cut
    (pod(grace=0), None, False),  # going at once already
    (pod(owner=None), None, False),  # not an AgentSandbox's pod
])
def test_the_hold_is_cut_only_when_its_sandbox_is_gone_or_going(
        the_pod: dict[str, Any], the_sandbox: dict[str, Any] | None, cut: bool) -> None:
    assert podspec.hold_to_cut(the_pod, the_sandbox) is cut


def test_the_operator_removes_a_deleted_sandboxs_held_pods_at_once() -> None:
    kube = FakeKube(None)  # type: ignore[arg-type]
    kube.pods = {"minimal-1": pod(), "minimal-2": pod("minimal-2", deleting=False),
                 "minimal-3": pod("minimal-3", grace=0)}
    assert run(kube, []) is None
    assert kube.calls == ["delete minimal-1"] and kube.graces == [0]


def test_a_sandbox_being_deleted_has_its_held_pods_removed(sandbox: dict[str, Any]) -> None:
    sandbox["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:00Z"
    kube = FakeKube(sandbox)
    kube.pods = {"minimal-1": pod()}
    assert run(kube, []) is None
    assert kube.calls == ["delete minimal-1"] and kube.graces == [0]


def test_a_sandbox_being_deleted_gets_no_new_pod(sandbox: dict[str, Any]) -> None:
    """Under a foreground delete the AgentSandbox stays until its pods are gone: a pod
    created for it then would be deleted by the garbage collector, and made again."""
    sandbox["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:00Z"
    sandbox["status"] = {"incarnation": 1, "podName": "minimal-1"}
    kube = FakeKube(sandbox)
    assert run(kube, []) is None
    assert kube.calls == [] and kube.pods == {}


def test_a_live_sandboxs_held_pod_is_left_to_the_node_agent(sandbox: dict[str, Any]) -> None:
    kube = FakeKube(sandbox)
    kube.pods = {"other-1": pod("other-1")}  # held, its sandbox lives: saved first
    run(kube, [])
    assert "delete other-1" not in kube.calls


def test_a_pending_checkpoint_of_a_sandbox_being_deleted_is_not_called_an_orphan(
        sandbox: dict[str, Any]) -> None:
    """Its AgentSandbox exists, being deleted: the Checkpoint is not failed as one of a
    sandbox that does not exist (it goes with the sandbox)."""
    sandbox["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:00Z"
    kube, events = FakeKube(sandbox), list[Any]()
    pending = {"apiVersion": api.API_VERSION, "kind": api.CHECKPOINT_KIND,
               "metadata": {"name": "minimal-manual", "namespace": "ns"},
               "spec": {"sandboxRef": {"name": "minimal"}, "reason": "Manual"}}
    assert driver.reconcile_checkpoint(kube, OperatorSettings(), pending,  # type: ignore[arg-type]
                                       lambda _o, e: events.append(e)) is None
    assert kube.checkpoints == {} and events == []


@pytest.mark.parametrize(("the_pod", "cut"), [
    (pod(), True),  # held for a checkpoint no one can create there: nothing to save
    (pod(deleting=False), False),  # not being deleted: the namespace controller's to end
    (pod(hold=False), False),
    (pod(grace=0), False),
])
def test_a_terminating_namespace_cuts_the_hold_though_its_sandbox_lives(
        the_pod: dict[str, Any], cut: bool) -> None:
    assert podspec.hold_to_cut(the_pod, box(), namespace_terminating=True) is cut


class TerminatingNamespace(FakeKube):
    """Creates nothing: the namespace is being deleted (the API's 403, cause
    NamespaceTerminating)."""

    def create_pod(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(f"create {manifest['metadata']['name']}")
        raise KubeNamespaceTerminating(
            "creating pod: unable to create new content in namespace ns because it is being "
            "terminated", status=403)


def test_a_sandbox_whose_namespace_is_being_deleted_has_its_held_pods_removed(
        sandbox: dict[str, Any]) -> None:
    """The namespace controller deleted its pod before the AgentSandbox: the operator's
    replacement pod is refused, and the held pod goes at once instead of sleeping out its
    grace period (no Checkpoint can be created there: it would wait for nothing)."""
    kube = TerminatingNamespace(sandbox)
    assert run(kube, []) is None
    assert kube.calls == ["create minimal-1"]  # a fresh sandbox: nothing held yet
    kube.calls.clear()
    kube.pods = {"minimal-1": pod()}
    assert run(kube, []) is None
    assert "delete minimal-1" in kube.calls and kube.graces == [0], kube.calls


def test_a_held_pod_in_a_namespace_being_deleted_goes_at_once(sandbox: dict[str, Any]) -> None:
    """The namespace controller deleted the pod, its AgentSandbox still lives: the operator
    reads the namespace (being deleted) and removes the held pod without waiting for an
    attempt to create anything there."""
    sandbox["status"] = {"incarnation": 1, "podName": "minimal-1"}
    kube = FakeKube(sandbox)
    kube.pods = {"minimal-1": pod()}
    kube.terminating = True
    assert run(kube, []) is None
    assert kube.calls == ["delete minimal-1"] and kube.graces == [0], kube.calls


def test_a_held_pod_in_a_live_namespace_waits_for_its_checkpoint(
        sandbox: dict[str, Any]) -> None:
    sandbox["status"] = {"incarnation": 1, "podName": "minimal-1"}
    kube = FakeKube(sandbox)
    kube.pods = {"minimal-1": pod()}
    run(kube, [])
    assert "delete minimal-1" not in kube.calls
