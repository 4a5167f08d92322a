"""The chart's ValidatingAdmissionPolicies on a real kube-apiserver (a throwaway control
plane, tests/support/controlplane.py): every write a node-agent, a tenant or the operator
makes is admitted or refused as
docs/protocol.md ("Who may write what") says. The callers are impersonated, with the
node-name claim a node-agent's bound token carries (Impersonate-Extra-...). The server
authorizes everything (AlwaysAllow): only the policies refuse here, so what RBAC would also
refuse (a Node's status, a Checkpoint's metadata) is shown refused by the policy itself.
Writes are server-side dry runs. (A policy's type-checking status is written by
kube-controller-manager, which this control plane does not run: a CEL error shows here as a
refusal that names the expression, which every case below would reveal.)"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from hermit_common import api, protocol
from hermit_node.control import planner
from tests.support.controlplane import ControlPlane, control_plane, install_crds
from tests.support.wait import wait_until

__all__ = ["control_plane"]

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RELEASE_NS = "hermit-system"
AGENT = f"system:serviceaccount:{RELEASE_NS}:hermit-node-agent"
OPERATOR = f"system:serviceaccount:{RELEASE_NS}:hermit-operator"
NODE_CLAIM = "authentication.kubernetes.io%2fnode-name"
NS = "agents"
G, V, P = api.GROUP, api.VERSION, api.CHECKPOINT_PLURAL
MERGE = "application/merge-patch+json"
Obj = dict[str, Any]


def _helm() -> str:
    cached = Path.home() / ".cache/hermit/bin"
    found = shutil.which("helm") or shutil.which("helm", path=str(cached))
    if found is None:
        pytest.fail("no helm binary on PATH or in ~/.cache/hermit/bin: run hack/install-helm")
    return found


def _policies() -> list[Obj]:
    out = subprocess.run(
        [_helm(), "template", "hermit", str(ROOT / "charts/hermit"), "--namespace", RELEASE_NS,
         "--set", "s3.bucket=checkpoints", "--set",
         "s3.scopedCredentials.roleArn=arn:aws:iam::123456789012:role/hermit-store", "--show-only",
         "templates/node-agent-policy.yaml"],
        check=True, capture_output=True, text=True, timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]


class Caller:
    """API calls as one identity (impersonated by the control plane's admin token)."""

    def __init__(self, plane: ControlPlane, user: str | None, node: str | None = None) -> None:
        from hermit_common.kubeclient import load_configuration

        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("KUBECONFIG", str(plane.kubeconfig))
            conf = load_configuration()
        self.plane = plane
        self.client = client.ApiClient(conf)
        if user is not None:
            self.client.set_default_header("Impersonate-User", user)
            self.client.set_default_header("Impersonate-Group", "system:authenticated")
        if node is not None:
            self.client.set_default_header(f"Impersonate-Extra-{NODE_CLAIM}", node)
        self.core = client.CoreV1Api(self.client)
        self.custom = client.CustomObjectsApi(self.client)

    @staticmethod
    def attempt(call: Callable[..., Any], *args: Any, **kwargs: Any) -> str | None:
        """None when admitted (a server-side dry run), else the refusal."""
        try:
            call(*args, dry_run="All", **kwargs)
        except ApiException as exc:
            return f"{exc.status}: {exc.body}"
        return None


def _ckpt(name: str, node: str, reason: str = protocol.PREEMPTION, **annotations: str) -> Obj:
    obj = protocol.checkpoint_object("box", name, reason, 1, node=node)
    if annotations:
        obj["metadata"]["annotations"] = annotations
    return obj


@pytest.fixture(scope="module")
def plane(control_plane: ControlPlane) -> Iterator[ControlPlane]:
    admin = Caller(control_plane, None)
    install_crds(admin.client)
    admin.core.create_namespace({"metadata": {"name": NS}})
    admin.core.create_namespaced_service_account(NS, {"metadata": {"name": "default"}})
    for node in ("node-a", "node-b"):
        admin.core.create_node({
            "metadata": {"name": node, "labels": {"zone": "z1"}, "annotations": {"n": "1"}},
            "spec": {"taints": [{"key": "other/taint", "effect": "NoSchedule"}],
                     "providerID": f"aws:///{node}"}})
    for pod, node in (("here", "node-a"), ("there", "node-b")):
        admin.core.create_namespaced_pod(NS, {
            "metadata": {"name": pod, "labels": {"app": "x"}, "annotations": {"team": "a"}},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]}})
    wait_until("the Checkpoint CRD served", 30, lambda: _served(admin), 0.1)
    for name, node in (("mine-1-preempt", "node-a"), ("theirs-1-preempt", "node-b")):
        admin.custom.create_namespaced_custom_object(G, V, NS, P, _ckpt(name, node))
    regs = client.AdmissionregistrationV1Api(admin.client)
    for doc in _policies():
        if doc["kind"] == "ValidatingAdmissionPolicy":
            regs.create_validating_admission_policy(doc)
        else:
            regs.create_validating_admission_policy_binding(doc)
    yield control_plane


def _served(admin: Caller) -> bool:
    try:
        admin.custom.list_namespaced_custom_object(G, V, NS, P)
        return True
    except ApiException:
        return False


@pytest.fixture(scope="module")
def agent(plane: ControlPlane) -> Caller:
    """The node-agent of node-a, once the policies are in force: each one on its own, as
    the API server loads each policy and binding in the background (under load, the
    Checkpoint ones came into force after the Node one had)."""
    caller = Caller(plane, AGENT, "node-a")
    tenant = Caller(plane, "alice")
    create = caller.custom.create_namespaced_custom_object
    probes: dict[str, Callable[[], str | None]] = {
        "Node": lambda: caller.attempt(
            caller.core.patch_node, "node-b", {"spec": {"unschedulable": True}},
            _content_type=MERGE),
        "Pod": lambda: caller.attempt(
            caller.core.patch_namespaced_pod, "there", NS,
            {"metadata": {"labels": {"x": "y"}}}, _content_type=MERGE),
        "Checkpoint": lambda: caller.attempt(
            create, G, V, NS, P, _ckpt("box-1-preempt", "node-b")),
        "Checkpoint trust": lambda: tenant.attempt(
            tenant.custom.create_namespaced_custom_object, G, V, NS, P,
            _ckpt("t-1", "node-a", protocol.MANUAL,
                  **{protocol.ANNOTATION_NODE_VERIFIED: "true"})),
    }
    for what, refused in probes.items():  # dry runs: nothing is written
        wait_until(f"the {what} policy in force", 120, lambda r=refused: r() is not None, 0.1)
    return caller


def _check(cases: list[tuple[str, str | None, str | None]]) -> None:
    """(what, None: admitted / a piece of the refusal, the refusal or None); all at once."""
    wrong = [f"{what}: wanted {'admitted' if want is None else repr(want)}, got "
             f"{'admitted' if got is None else got[:300]}"
             for what, want, got in cases if _wrong(want, got)]
    assert not wrong, "\n".join(wrong)


def _wrong(want: str | None, got: str | None) -> bool:
    if want is None:
        return got is not None
    return got is None or want not in got


def test_a_node_agent_changes_only_the_interruption_taint_and_cordon_of_its_node(
        agent: Caller, plane: ControlPlane) -> None:
    patch = agent.core.patch_node
    # As the agent patches (planner.node_taint_patch): the node's own taints (here also the
    # not-ready taint the API server adds to a new Node), the interruption taint appended.
    node = client.CoreV1Api(Caller(plane, None).client).read_node("node-a")
    taints = [{"key": t.key, "effect": t.effect, **({"value": t.value} if t.value else {})}
              for t in node.spec.taints or []]
    taint = {"key": protocol.TAINT_INTERRUPTION, "value": "spot", "effect": "NoSchedule"}
    refused_field = "never another taint or spec field"
    _check([
        ("taint and cordon", None, agent.attempt(
            patch, "node-a", {"spec": {"unschedulable": True, "taints": [*taints, taint]}},
            _content_type=MERGE)),
        ("uncordon", None, agent.attempt(patch, "node-a", {"spec": {"unschedulable": False}},
                                         _content_type=MERGE)),
        *[(f"label {k}", "never its labels", agent.attempt(
            patch, "node-a", {"metadata": {"labels": {k: "x"}}}, _content_type=MERGE))
          for k in ("node-role.kubernetes.io/control-plane",
                    "node-restriction.kubernetes.io/x", "zone")],
        ("annotation", "never its labels, annotations", agent.attempt(
            patch, "node-a", {"metadata": {"annotations": {"x": "y"}}}, _content_type=MERGE)),
        # Its readiness label (planner.node_ready_patch): that value only, its own node only.
        ("ready label", None, agent.attempt(
            patch, "node-a", {"metadata": {"labels": {
                protocol.LABEL_NODE_AGENT: protocol.NODE_AGENT_READY}}}, _content_type=MERGE)),
        ("ready label, another value", "never its labels", agent.attempt(
            patch, "node-a", {"metadata": {"labels": {protocol.LABEL_NODE_AGENT: "x"}}},
            _content_type=MERGE)),
        ("ready label and another label", "never its labels", agent.attempt(
            patch, "node-a", {"metadata": {"labels": {
                protocol.LABEL_NODE_AGENT: protocol.NODE_AGENT_READY, "zone": "z2"}}},
            _content_type=MERGE)),
        ("a label removed", "never its labels", agent.attempt(
            patch, "node-a", {"metadata": {"labels": {"zone": None}}}, _content_type=MERGE)),
        ("ready label on another node", "only its own node (node-a)", agent.attempt(
            patch, "node-b", {"metadata": {"labels": {
                protocol.LABEL_NODE_AGENT: protocol.NODE_AGENT_READY}}}, _content_type=MERGE)),
        # The checkpoint format it reads (protocol.LABEL_CHECKPOINT_FORMAT): a decimal
        # integer only, with the ready label as planner.node_ready_patch writes both.
        ("format label", None, agent.attempt(
            patch, "node-a", {"metadata": {"labels": {
                protocol.LABEL_CHECKPOINT_FORMAT: str(protocol.CHECKPOINT_FORMAT_LEVEL)}}},
            _content_type=MERGE)),
        ("ready and format labels", None, agent.attempt(
            patch, "node-a", {"metadata": {"labels": {
                protocol.LABEL_NODE_AGENT: protocol.NODE_AGENT_READY,
                protocol.LABEL_CHECKPOINT_FORMAT: "2"}}}, _content_type=MERGE)),
        ("format label, the highest level", None, agent.attempt(
            patch, "node-a", {"metadata": {"labels": {
                protocol.LABEL_CHECKPOINT_FORMAT: str(protocol.MAX_FORMAT_LEVEL)}}},
            _content_type=MERGE)),
        *[(f"format label {value!r}", "never its labels", agent.attempt(
            patch, "node-a", {"metadata": {"labels": {protocol.LABEL_CHECKPOINT_FORMAT: value}}},
            _content_type=MERGE))
          for value in ("two", "0", "02", "1.5", "2x", "1000001", "99999999999999999999")],
        ("format label and another label", "never its labels", agent.attempt(
            patch, "node-a", {"metadata": {"labels": {
                protocol.LABEL_CHECKPOINT_FORMAT: "2", "zone": "z2"}}}, _content_type=MERGE)),
        ("format label on another node", "only its own node (node-a)", agent.attempt(
            patch, "node-b", {"metadata": {"labels": {
                protocol.LABEL_CHECKPOINT_FORMAT: "2"}}}, _content_type=MERGE)),
        ("owner", "owners or finalizers", agent.attempt(patch, "node-a", {"metadata": {
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": "node-b",
                                 "uid": "u"}]}}, _content_type=MERGE)),
        ("another taint", refused_field, agent.attempt(
            patch, "node-a",
            {"spec": {"taints": [*taints, {"key": "evil", "effect": "NoSchedule"}]}},
            _content_type=MERGE)),
        ("a taint removed", refused_field, agent.attempt(
            patch, "node-a", {"spec": {"taints": []}}, _content_type=MERGE)),
        ("interruption NoExecute", refused_field, agent.attempt(
            patch, "node-a", {"spec": {"taints": [*taints, {**taint, "effect": "NoExecute"}]}},
            _content_type=MERGE)),
        ("podCIDR", refused_field, agent.attempt(
            patch, "node-a", {"spec": {"podCIDR": "10.9.0.0/24"}}, _content_type=MERGE)),
        ("status", "never writes a Node's status", agent.attempt(
            agent.core.patch_node_status, "node-a", {"status": {"conditions": []}},
            _content_type=MERGE)),
        ("another node", "only its own node (node-a)", agent.attempt(
            patch, "node-b", {"spec": {"unschedulable": True}}, _content_type=MERGE)),
        ("no node claim", "names no node", Caller.attempt(
            Caller(agent.plane, AGENT).core.patch_node, "node-a",
            {"spec": {"unschedulable": True}}, _content_type=MERGE)),
    ])


def test_a_node_agent_never_removes_its_ready_label_but_taints_a_node_labelled_otherwise(
        agent: Caller, plane: ControlPlane) -> None:
    """The label once there (the agent never removes it); a value someone else set (here
    an admin's) neither blocks the agent's taint and cordon nor may the agent change it
    but to ready."""
    admin = client.CoreV1Api(Caller(plane, None).client)
    patch = agent.core.patch_node
    try:
        for value in (protocol.NODE_AGENT_READY, "drained"):
            admin.patch_node("node-a", {"metadata": {"labels": {
                protocol.LABEL_NODE_AGENT: value}}})
            _check([
                (f"{value}: removed", "never its labels", agent.attempt(
                    patch, "node-a", {"metadata": {"labels": {protocol.LABEL_NODE_AGENT: None}}},
                    _content_type=MERGE)),
                (f"{value}: cordon", None, agent.attempt(
                    patch, "node-a", {"spec": {"unschedulable": True}}, _content_type=MERGE)),
                (f"{value}: set to ready", None, agent.attempt(
                    patch, "node-a", {"metadata": {"labels": {
                        protocol.LABEL_NODE_AGENT: protocol.NODE_AGENT_READY}}},
                    _content_type=MERGE)),
            ])
    finally:
        admin.patch_node("node-a", {"metadata": {"labels": {protocol.LABEL_NODE_AGENT: None}}})


def test_a_node_agent_changes_its_format_label_but_never_removes_it(
        agent: Caller, plane: ControlPlane) -> None:
    """Once there (here an admin's, as a node-agent's would be), the format label may be
    set to another level (an upgrade, or a rollback to a release that sets it) and stay
    as it is while the taint is written, never be removed or made a non-number."""
    admin = client.CoreV1Api(Caller(plane, None).client)
    patch = agent.core.patch_node
    label = protocol.LABEL_CHECKPOINT_FORMAT

    def labels(value: str | None) -> str | None:
        return agent.attempt(patch, "node-a", {"metadata": {"labels": {label: value}}},
                             _content_type=MERGE)

    try:
        admin.patch_node("node-a", {"metadata": {"labels": {label: "2"}}})
        _check([
            ("removed", "never its labels", labels(None)),
            ("cordon", None, agent.attempt(
                patch, "node-a", {"spec": {"unschedulable": True}}, _content_type=MERGE)),
            ("the same level", None, labels("2")),
            ("a higher level", None, labels("3")),
            ("a lower level", None, labels("1")),
            ("not a number", "never its labels", labels("v2")),
            ("empty", "never its labels", labels("")),
        ])
    finally:
        admin.patch_node("node-a", {"metadata": {"labels": {label: None}}})


def test_a_node_agent_writes_only_the_restore_annotations_of_pods_on_its_node(
        agent: Caller) -> None:
    patch = agent.core.patch_namespaced_pod
    only = "only the pod annotations it reports a restore with"

    def annotate(pod: str, annotations: dict[str, str | None]) -> str | None:
        return agent.attempt(patch, pod, NS, {"metadata": {"annotations": annotations}},
                             _content_type=MERGE)

    _check([
        ("restore annotations", None, annotate("here", {
            k: "x" for k in protocol.NODE_AGENT_POD_ANNOTATIONS})),
        ("restore-from", only, annotate("here", {protocol.ANNOTATION_RESTORE_FROM: "c"})),
        ("another annotation", only, annotate("here", {"e2e": "x"})),
        ("an annotation removed", only, annotate("here", {"team": None})),
        ("on another node", "only pods on its own node", annotate("there", {
            protocol.ANNOTATION_RESTORE_PHASE: "Failed"})),
        ("label", "labels, owners or finalizers", agent.attempt(
            patch, "here", NS, {"metadata": {"labels": {protocol.LABEL_SANDBOX: "box"}}},
            _content_type=MERGE)),
        ("owner", "labels, owners or finalizers", agent.attempt(
            patch, "here", NS, {"metadata": {"ownerReferences": [{
                "apiVersion": api.API_VERSION, "kind": api.SANDBOX_KIND, "name": "box",
                "uid": "u"}]}}, _content_type=MERGE)),
        ("finalizer", "labels, owners or finalizers", agent.attempt(
            patch, "here", NS, {"metadata": {"finalizers": ["x/y"]}}, _content_type=MERGE)),
        ("image", "never its spec", agent.attempt(
            patch, "here", NS, {"spec": {"containers": [{"name": "c", "image": "evil"}]}},
            _content_type="application/strategic-merge-patch+json")),
        ("status", "writes no subresource", agent.attempt(
            agent.core.patch_namespaced_pod_status, "here", NS, {"status": {"phase": "Failed"}},
            _content_type=MERGE)),
        ("create", "creates none", agent.attempt(
            agent.core.create_namespaced_pod, NS, {
                "metadata": {"name": "new"},
                "spec": {"nodeName": "node-a", "containers": [{"name": "c", "image": "x"}]}})),
        ("delete", "deletes nothing", agent.attempt(
            agent.core.delete_namespaced_pod, "here", NS)),
    ])


def test_a_node_agent_creates_only_its_own_checkpoints_and_reports_only_its_nodes(
        agent: Caller) -> None:
    create = agent.custom.create_namespaced_custom_object
    names = "under the names the protocol gives them"
    owned = _ckpt("box-1-evict", "node-a", protocol.EVICTION)
    owned["metadata"]["ownerReferences"] = [{"apiVersion": api.API_VERSION,
                                             "kind": api.SANDBOX_KIND, "name": "box",
                                             "uid": "u"}]
    _check([
        *[(f"create {n}", None, agent.attempt(create, G, V, NS, P, _ckpt(n, "node-a", r)))
          for n, r in (("box-1-preempt", protocol.PREEMPTION),
                       ("box-1-preempt-r2-0a1b2c3d", protocol.PREEMPTION),
                       ("box-1-evict-r3", protocol.EVICTION),
                       ("box-1-rebalance", protocol.REBALANCE),
                       ("box-1-turn7-0a1b2c3d", protocol.TURN))],
        ("another node's label", "labelled hermit.dev/node=node-a",
         agent.attempt(create, G, V, NS, P, _ckpt("box-1-preempt", "node-b"))),
        # Both the node-agent policy and hermit-checkpoint-trust refuse it; which message
        # the API server reports depends on the order it evaluates them in.
        ("marked verified", "only the operator", agent.attempt(create, G, V, NS, P, _ckpt(
            "box-1-preempt", "node-a", **{protocol.ANNOTATION_NODE_VERIFIED: "true"}))),
        ("an Interval", names, agent.attempt(create, G, V, NS, P, _ckpt(
            "box-1-i1767268800", "node-a", protocol.INTERVAL))),
        ("the Suspend name", names, agent.attempt(create, G, V, NS, P, _ckpt(
            "box-1-suspend", "node-a"))),
        ("a user's name", names, agent.attempt(create, G, V, NS, P, _ckpt(
            "my-checkpoint", "node-a"))),
        ("an owner", "no owner references or finalizers",
         agent.attempt(create, G, V, NS, P, owned)),
        ("its node's status", None, agent.attempt(
            agent.custom.patch_namespaced_custom_object_status, G, V, NS, P, "mine-1-preempt",
            {"status": {"phase": protocol.DUMPING, "nodeName": "node-a"}},
            _content_type=MERGE)),
        ("another node's status", "labelled hermit.dev/node=node-a", agent.attempt(
            agent.custom.patch_namespaced_custom_object_status, G, V, NS, P,
            "theirs-1-preempt", {"status": {"phase": protocol.FAILED}}, _content_type=MERGE)),
        ("metadata", "never changes their metadata", agent.attempt(
            agent.custom.patch_namespaced_custom_object, G, V, NS, P, "mine-1-preempt",
            {"metadata": {"labels": {protocol.LABEL_NODE: "node-b"}}}, _content_type=MERGE)),
        ("delete", "deletes nothing", agent.attempt(
            agent.custom.delete_namespaced_custom_object, G, V, NS, P, "mine-1-preempt")),
    ])


def test_the_checkpoint_format_level_a_node_agent_writes_is_kept(agent: Caller) -> None:
    """status.formatLevel as the planner writes it with Dumping is admitted and served back
    (the CRD keeps it: an unknown field would be pruned and the checkpoint would look like
    level 1); a level below 1 is refused by the schema."""
    dumping = planner.status_dumping("node-a", datetime(2026, 1, 1, tzinfo=UTC))
    assert dumping["formatLevel"] == protocol.CHECKPOINT_FORMAT_LEVEL
    served = agent.custom.patch_namespaced_custom_object_status(
        G, V, NS, P, "mine-1-preempt", {"status": dumping}, _content_type=MERGE, dry_run="All")
    assert served["status"]["formatLevel"] == protocol.CHECKPOINT_FORMAT_LEVEL
    _check([("level 0", "formatLevel", agent.attempt(
        agent.custom.patch_namespaced_custom_object_status, G, V, NS, P, "mine-1-preempt",
        {"status": {**dumping, "formatLevel": 0}}, _content_type=MERGE))])


def test_only_the_operator_marks_a_checkpoint_verified(agent: Caller, plane: ControlPlane
                                                       ) -> None:
    tenant = Caller(plane, "alice")
    operator = Caller(plane, OPERATOR)
    mark = {protocol.ANNOTATION_NODE_VERIFIED: "true"}
    operator.custom.create_namespaced_custom_object(G, V, NS, P, _ckpt("marked-1-i5", "node-a",
                                                                       protocol.INTERVAL, **mark))
    only = "only the operator ("

    def annotate(who: Caller, name: str, annotations: dict[str, str | None]) -> str | None:
        return who.attempt(who.custom.patch_namespaced_custom_object, G, V, NS, P, name,
                           {"metadata": {"annotations": annotations}}, _content_type=MERGE)

    _check([
        ("tenant creates one marked", only, tenant.attempt(
            tenant.custom.create_namespaced_custom_object, G, V, NS, P,
            _ckpt("t-1", "node-a", protocol.MANUAL, **mark))),
        ("tenant creates one", None, tenant.attempt(
            tenant.custom.create_namespaced_custom_object, G, V, NS, P,
            _ckpt("t-2", "node-a", protocol.MANUAL))),
        ("tenant marks one", only, annotate(tenant, "mine-1-preempt", mark)),
        ("tenant changes the mark", only, annotate(
            tenant, "marked-1-i5", {protocol.ANNOTATION_NODE_VERIFIED: "yes"})),
        ("tenant keeps the mark, changes a label", None, tenant.attempt(
            tenant.custom.patch_namespaced_custom_object, G, V, NS, P, "marked-1-i5",
            {"metadata": {"labels": {"x": "y"}}}, _content_type=MERGE)),
        ("tenant removes the mark", None, annotate(
            tenant, "marked-1-i5", {protocol.ANNOTATION_NODE_VERIFIED: None})),
        ("operator marks one", None, annotate(operator, "mine-1-preempt", mark)),
    ])
