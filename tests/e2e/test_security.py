"""Least privilege on the cluster: each service account holds exactly the rules
docs/security.md lists, and a node-agent's own token is refused on another node's objects
and on everything of its own node the protocol does not need (the chart's
ValidatingAdmissionPolicies). Its writes are server-side dry runs (admission runs, nothing
changes), except where another node's Checkpoints must really exist to show they block
nothing, and a faked restore pod must really run to show it is not restored."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from hermit_common import api, protocol
from tests.e2e import sandboxes as sb
from tests.e2e.cluster import (
    BUCKET,
    RELEASE_NS,
    REPO,
    S3,
    E2EConfig,
    Kube,
    pod_manifest,
    wait_pod_phase,
    wait_until,
)
from tests.support.attacks import CONTAINED, REFUSED, Attack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

Obj = dict[str, Any]

COMPONENTS = ("operator", "node-agent")
# Rules every authenticated user has (system:basic-user, system:discovery, ...).
EVERYONE = re.compile(r"^self\w+reviews\.|^selfsubject")


def kubectl(cfg: E2EConfig) -> str:
    cache = Path(os.environ.get("HERMIT_CACHE", Path.home() / ".cache/hermit"))
    path = cache / "bin" / "kubectl"
    if not path.exists():
        pytest.fail(f"kubectl not found at {path}: run hack/install-k8s")
    return str(path)


def documented_rules() -> dict[str, dict[str, set[str]]]:
    """account -> resource -> verbs, from the table in docs/security.md."""
    text = (REPO / "docs/security.md").read_text()
    table = text.split("<!-- rbac-table: begin -->")[1].split("<!-- rbac-table: end -->")[0]
    out: dict[str, dict[str, set[str]]] = {}
    for line in table.strip().splitlines()[2:]:
        account, resource, verbs = (cell.strip() for cell in line.strip("|").split("|")[:3])
        out.setdefault(account, {})[resource] = {v.strip() for v in verbs.split(",")}
    return out


def granted_rules(cfg: E2EConfig, account: str) -> dict[str, set[str]]:
    """resource -> verbs that `kubectl auth can-i --list` shows for the account (resource
    rules only, without the ones every authenticated user has)."""
    proc = subprocess.run(
        [kubectl(cfg), "--kubeconfig", cfg.kubeconfig, "auth", "can-i", "--list", "-n",
         RELEASE_NS, f"--as=system:serviceaccount:{RELEASE_NS}:{account}"],
        capture_output=True, text=True, check=True)
    out: dict[str, set[str]] = {}
    for line in proc.stdout.splitlines()[1:]:
        m = re.match(r"^(\S+)\s+\[(.*?)\]\s+\[(.*?)\]\s+\[(.*?)\]\s*$", line)
        if m is None or m.group(2) or EVERYONE.search(m.group(1)):
            continue  # non-resource URLs, the everyone rules
        out.setdefault(m.group(1), set()).update(m.group(4).split())
    return out


def service_account(kube: Kube, component: str) -> str:
    """The service account the chart's pods of this component run as."""
    return sb.service_account(kube, RELEASE_NS, component)


def test_each_account_holds_exactly_the_documented_rules(
        kube: Kube, hermit_release: str, e2e_config: E2EConfig) -> None:
    documented = documented_rules()
    for account in COMPONENTS:
        granted = granted_rules(e2e_config, service_account(kube, account))
        print(f"\n{account}: " + "; ".join(f"{r} {sorted(v)}" for r, v in sorted(granted.items())))
        assert granted == documented[account], (
            f"{account}: can-i --list differs from docs/security.md:\n"
            f"  granted only: {_diff(granted, documented[account])}\n"
            f"  documented only: {_diff(documented[account], granted)}")


def _diff(a: dict[str, set[str]], b: dict[str, set[str]]) -> dict[str, list[str]]:
    return {r: sorted(v - b.get(r, set())) for r, v in a.items() if v - b.get(r, set())}


class NodeAgentToken:
    """API calls as one node-agent pod (its bound token names its node), as dry runs."""

    def __init__(self, cfg: E2EConfig, kube: Kube, pod: str) -> None:
        api_client = sb.node_agent_api_client(cfg, kube, RELEASE_NS, pod)
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)

    @staticmethod
    def attempt(call: Callable[..., Any], *args: Any) -> str | None:
        """None when the API server admits the call (a server-side dry run), else why not."""
        try:
            call(*args, dry_run="All")
        except ApiException as exc:
            return f"{exc.status} {exc.reason}: {exc.body}"
        return None


@pytest.fixture
def node_agent(kube: Kube, hermit_release: str, e2e_config: E2EConfig
               ) -> tuple[NodeAgentToken, str, str]:
    """(a token of the node-agent on node A, node A, another node B)."""
    pods = kube.api.list_namespaced_pod(
        RELEASE_NS, label_selector="app.kubernetes.io/component=node-agent").items
    running = [p for p in pods if p.status.phase == "Running" and p.spec.node_name]
    assert len(running) >= 2, "needs node-agents on two nodes"
    mine, other = running[0], running[1]
    return (NodeAgentToken(e2e_config, kube, mine.metadata.name), mine.spec.node_name,
            other.spec.node_name)


def _refused(why: str | None, says: str) -> None:
    assert why is not None, f"admitted, but should be refused ({says})"
    assert says in why, why
    print(f"  refused: {why[:200]}")


def _interruption_patch(kube: Kube, node: str) -> dict[str, Any]:
    """The merge patch a node-agent makes on a notice (planner.node_taint_patch): the
    interruption taint added to the node's own taints, and the cordon."""
    taints = [t for t in (kube.node(node) or {}).get("spec", {}).get("taints") or []
              if t.get("key") != protocol.TAINT_INTERRUPTION]
    taint = {"key": protocol.TAINT_INTERRUPTION, "value": "e2e", "effect": "NoSchedule"}
    return {"spec": {"unschedulable": True, "taints": [*taints, taint]}}


@pytest.mark.attack
def test_a_node_agent_token_is_refused_on_another_nodes_objects(
        kube: Kube, namespace: str, e2e_config: E2EConfig,
        node_agent: tuple[NodeAgentToken, str, str], attack: Attack) -> None:
    agent, mine, other = node_agent
    print(f"\nnode-agent of {mine}:")
    assert agent.attempt(agent.core.patch_node, mine, _interruption_patch(kube, mine)) is None
    _refused(agent.attempt(agent.core.patch_node, other, _interruption_patch(kube, other)),
             f"may change only its own node ({mine})")

    for name, node in (("here", mine), ("there", other)):
        kube.create_pod(namespace, pod_manifest(name, node, e2e_config.sandbox_image,
                                                ["sleep", "3600"]))
        wait_pod_phase(kube, namespace, name, {"Running"})
    note = {"metadata": {"annotations": {protocol.ANNOTATION_RESTORE_MESSAGE: "e2e"}}}
    assert agent.attempt(agent.core.patch_namespaced_pod, "here", namespace, note) is None
    _refused(agent.attempt(agent.core.patch_namespaced_pod, "there", namespace, note),
             f"only pods on its own node ({mine})")
    container = pod_manifest("here", mine, "", [])["spec"]["containers"][0]["name"]
    swap = {"spec": {"containers": [{"name": container, "image": "evil:1"}]}}
    _refused(agent.attempt(agent.core.patch_namespaced_pod, "here", namespace, swap),
             "never its spec")

    def checkpoint(node: str, **annotations: str) -> dict[str, Any]:
        box = f"box{uuid.uuid4().hex[:6]}"
        obj: Any = protocol.checkpoint_object(
            box, protocol.checkpoint_name(box, 1, protocol.PREEMPTION), protocol.PREEMPTION,
            1, namespace=namespace, node=node)
        if annotations:
            obj["metadata"]["annotations"] = annotations
        return dict(obj)

    create = agent.custom.create_namespaced_custom_object
    where = (api.GROUP, api.VERSION, namespace, api.CHECKPOINT_PLURAL)
    assert agent.attempt(create, *where, checkpoint(mine)) is None
    _refused(agent.attempt(create, *where, checkpoint(other)),
             f"Checkpoints labelled hermit.dev/node={mine}")
    _refused(agent.attempt(create, *where, checkpoint(
        # Refused by the node-agent's own policy and by the checkpoint-trust policy, which
        # the API server may evaluate in either order: both say it is the operator's mark.
        mine, **{protocol.ANNOTATION_NODE_VERIFIED: "true"})),
        "a Checkpoint hermit.dev/node-verified")
    try:
        agent.core.list_namespaced_secret(RELEASE_NS)
        raise AssertionError("the node-agent can list Secrets")
    except ApiException as exc:
        assert exc.status == 403
    attack.record("node-agent token against another node's objects",
                  tried=f"{mine}'s node-agent token: cordon and taint {other}, annotate a pod "
                        f"on {other}, create a Checkpoint labelled {other} or marked verified, "
                        "list Secrets",
                  outcome=REFUSED,
                  evidence="each refused by the API server (the node-scope policies, RBAC "
                           "for Secrets); the same writes on its own node admitted")


# -- Deliver 4: node-agent writes narrowed to what the protocol needs ----------------------

@pytest.mark.attack
def test_a_node_agent_token_changes_only_the_interruption_taint_and_cordon_of_its_node(
        kube: Kube, node_agent: tuple[NodeAgentToken, str, str], attack: Attack) -> None:
    """NodeRestriction keeps a kubelet from node-role.kubernetes.io/* and
    node-restriction.kubernetes.io/* labels; the node-agent's token must not be the way
    around it, nor change any other taint (say, to pull workloads onto its node)."""
    agent, mine, _ = node_agent
    print(f"\nnode-agent of {mine}:")
    assert agent.attempt(agent.core.patch_node, mine, _interruption_patch(kube, mine)) is None
    assert agent.attempt(agent.core.patch_node, mine, {"spec": {"unschedulable": True}}) is None
    # Its readiness label, that value only (the agent has set it already: a no-op here).
    ready = {protocol.LABEL_NODE_AGENT: protocol.NODE_AGENT_READY}
    assert agent.attempt(agent.core.patch_node, mine, {"metadata": {"labels": ready}}) is None
    for label in ("node-role.kubernetes.io/control-plane", "node-restriction.kubernetes.io/x",
                  "hermit.dev/e2e", protocol.LABEL_NODE_AGENT):
        _refused(agent.attempt(agent.core.patch_node, mine,
                               {"metadata": {"labels": {label: "x"}}}), "never its labels")
    _refused(agent.attempt(agent.core.patch_node, mine, {"metadata": {"labels": {
        protocol.LABEL_NODE_AGENT: None}}}), "never its labels")
    _refused(agent.attempt(agent.core.patch_node, mine,
                           {"metadata": {"annotations": {"hermit.dev/e2e": "x"}}}),
             "never its labels, annotations")
    taints = [t for t in (kube.node(mine) or {}).get("spec", {}).get("taints") or []
              if t.get("key") != protocol.TAINT_INTERRUPTION]
    for wrong in ({"key": "e2e/other", "effect": "NoSchedule"},
                  {"key": protocol.TAINT_INTERRUPTION, "effect": "NoExecute"}):
        _refused(agent.attempt(agent.core.patch_node, mine,
                               {"spec": {"taints": [*taints, wrong]}}),
                 "never another taint or spec field")
    if taints:
        _refused(agent.attempt(agent.core.patch_node, mine, {"spec": {"taints": []}}),
                 "never another taint or spec field")
    attack.record("node-agent token on its own Node",
                  tried="label it node-role.kubernetes.io/control-plane and "
                        "node-restriction.kubernetes.io/x, set hermit.dev/node-agent to "
                        "another value than ready or remove it, annotate it, add a taint, "
                        "add the interruption taint as NoExecute, remove its taints",
                  outcome=REFUSED,
                  evidence="all refused (node-scope policy); only the interruption taint "
                           "(NoSchedule), spec.unschedulable and hermit.dev/node-agent=ready "
                           "admitted")


@pytest.mark.attack
def test_a_node_agent_token_writes_only_hermits_restore_annotations_on_its_pods(
        kube: Kube, namespace: str, e2e_config: E2EConfig,
        node_agent: tuple[NodeAgentToken, str, str], attack: Attack) -> None:
    agent, mine, _ = node_agent
    kube.create_pod(namespace, pod_manifest("here", mine, e2e_config.sandbox_image,
                                            ["sleep", "3600"]))
    wait_pod_phase(kube, namespace, "here", {"Running"})
    patch = functools.partial(agent.attempt, agent.core.patch_namespaced_pod, "here",
                              namespace)
    print(f"\nnode-agent of {mine}:")
    for key in protocol.NODE_AGENT_POD_ANNOTATIONS:
        assert patch({"metadata": {"annotations": {key: "x"}}}) is None, key
    for key in ("e2e/note", protocol.ANNOTATION_RESTORE_FROM,
                protocol.ANNOTATION_WORKSPACE_PATH):
        _refused(patch({"metadata": {"annotations": {key: "x"}}}),
                 "only the pod annotations it reports a restore with")
    _refused(patch({"metadata": {"labels": {protocol.LABEL_SANDBOX: "box"}}}),
             "labels, owners or finalizers")
    _refused(patch({"metadata": {"finalizers": ["e2e/hold"]}}), "labels, owners or finalizers")
    _refused(patch({"metadata": {"ownerReferences": [{
        "apiVersion": api.API_VERSION, "kind": api.SANDBOX_KIND, "name": "box",
        "uid": str(uuid.uuid4())}]}}), "labels, owners or finalizers")
    attack.record("node-agent token on pods of its node",
                  tried="set hermit.dev/restore-from, workspace-path or a foreign annotation, "
                        "label a pod as a sandbox's, add a finalizer or an owner reference",
                  outcome=REFUSED,
                  evidence="all refused (pod-scope policy); only the three restore "
                           "annotations admitted")


@pytest.mark.attack
def test_another_node_pre_creating_a_sandboxs_checkpoints_blocks_nothing(
        kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig,
        attack: Attack) -> None:
    """A node that does not run the sandbox creates (for real) the Checkpoint names the
    sandbox's own node would use on a notice and a Pending request that used to hold
    interval checkpoints back. The operator fails them (CheckpointUntrusted), interval
    checkpoints go on, and a real spot notice on the sandbox's node still checkpoints and
    moves it (its request under another name, hermit_node/control/requests.py)."""
    name, where = sb.start_on_spot(kube, e2e_config, hermit_release, namespace,
                                   checkpoint={"intervalSeconds": 30})
    incarnation = int(sb.status(namespace, name)["incarnation"])
    agents = kube.api.list_namespaced_pod(
        RELEASE_NS, label_selector="app.kubernetes.io/component=node-agent").items
    squatter: Any = next(p for p in agents if p.status.phase == "Running"
                         and p.spec.node_name and p.spec.node_name != where.node)
    there = str(squatter.spec.node_name)
    token = NodeAgentToken(e2e_config, kube, str(squatter.metadata.name))
    # The names the sandbox's own node would give its stopping requests on a notice...
    squats = [protocol.checkpoint_name(name, incarnation, protocol.PREEMPTION, tag)
              for tag in ("", "-r2")]
    # ...and a request of an earlier incarnation that nobody will ever serve: Pending, it
    # held interval checkpoints back for an hour.
    pending = protocol.checkpoint_name(name, incarnation - 1, protocol.TURN, "1")
    for squat, reason, of in [*((n, protocol.PREEMPTION, incarnation) for n in squats),
                              (pending, protocol.TURN, incarnation - 1)]:
        token.custom.create_namespaced_custom_object(
            api.GROUP, api.VERSION, namespace, api.CHECKPOINT_PLURAL,
            protocol.checkpoint_object(name, squat, reason, of, node=there))
    print(f"\n{there} created {[*squats, pending]} for {name}, which runs on {where.node}")

    def untrusted() -> list[str] | None:
        failed = [c for c in sb.checkpoints(namespace) if c["metadata"]["name"] in squats
                  and (c.get("status") or {}).get("phase") == "Failed"]
        return [c["status"]["message"] for c in failed] if len(failed) == len(squats) else None

    messages = wait_until("the squatted Checkpoints failed by the operator", 60, untrusted)
    assert all(f"labelled for node {there}" in m for m in messages), messages
    # The operator posts its Events through kopf's queue: one may land just after the
    # status that the wait above saw.
    wait_until("a CheckpointUntrusted Event", 30, lambda: any(
        e["reason"] == api.REASON_CHECKPOINT_UNTRUSTED for e in sb.events(kube, namespace, name)))

    def interval_done() -> Obj | None:
        return next((c for c in sb.checkpoints(namespace)
                     if c["spec"]["reason"] == protocol.INTERVAL
                     and (c.get("status") or {}).get("phase") == "Completed"), None)

    interval = wait_until("an Interval checkpoint despite the squatted requests", 150,
                          interval_done, 2)
    print(f"  interval checkpoint {interval['metadata']['name']} Completed; {pending} is "
          "still Pending, ignored")

    sb.wait_agent_ready(kube, RELEASE_NS, where.node)
    with sb.preempting(e2e_config, where.node, 20):
        def stopped() -> Obj | None:
            for c in sb.checkpoints(namespace):
                labels = c["metadata"].get("labels") or {}
                if (c["spec"]["reason"] == protocol.PREEMPTION
                        and labels.get(protocol.LABEL_NODE) == where.node
                        and (c.get("status") or {}).get("phase") == "Completed"):
                    return c
            return None

        real = wait_until("the real Preemption checkpoint Completed", 20, stopped, 0.2)
        assert real["metadata"]["name"] not in squats
        print(f"  the notice's checkpoint: {real['metadata']['name']}")
        after = sb.wait_running(kube, namespace, name, restores=1, avoid=where.node,
                                timeout=180, min_ticks=1)
        assert sb.status(namespace, name)["restoredFrom"]["name"] == real["metadata"]["name"]
        print(f"  moved to {after.node}")
    attack.record("another node pre-creates a sandbox's checkpoints",
                  tried=f"{there}'s node-agent token created {', '.join(squats)} (the names "
                        f"{where.node} gives its stopping requests) and a Pending {pending}",
                  outcome=CONTAINED,
                  evidence=f"the operator failed them CheckpointUntrusted and ignored {pending}; "
                           f"Interval checkpoint {interval['metadata']['name']} Completed; the "
                           f"notice's checkpoint {real['metadata']['name']} Completed and the "
                           f"sandbox moved to {after.node} from it")


@pytest.mark.attack
def test_a_pod_faked_with_the_sandbox_label_and_a_restore_from_is_not_restored(
        kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig,
        attack: Attack) -> None:
    """Someone who may create pods (not the operator) makes one that looks like a
    sandbox's: its label, an owner reference to the AgentSandbox's uid, and
    hermit.dev/restore-from naming the sandbox's verified checkpoint. The node-agent
    refuses (the sandbox's status names another pod): a Failed restore-phase saying why,
    a RestoreRefused Event, nothing restored into it."""
    name, where = sb.start_on_spot(kube, e2e_config, hermit_release, namespace)
    manual = f"{name}-manual"
    sb.custom().create_namespaced_custom_object(
        api.GROUP, api.VERSION, namespace, api.CHECKPOINT_PLURAL,
        protocol.checkpoint_object(name, manual, protocol.MANUAL))

    def verified() -> Obj | None:
        c = next((c for c in sb.checkpoints(namespace) if c["metadata"]["name"] == manual),
                 None)
        if c is None or (c.get("status") or {}).get("phase") != "Completed":
            return None
        marks = c["metadata"].get("annotations") or {}
        return c if marks.get(protocol.ANNOTATION_NODE_VERIFIED) == "true" else None

    wait_until(f"checkpoint {manual} Completed and verified", 120, verified)
    owner = sb.sandbox(namespace, name)
    fake = pod_manifest("fake-restore", where.node, e2e_config.sandbox_image,
                        ["sleep", "3600"])
    fake["metadata"]["labels"].update({protocol.LABEL_SANDBOX: name,
                                       protocol.LABEL_INCARNATION: "7"})
    fake["metadata"]["annotations"] = {protocol.ANNOTATION_RESTORE_FROM: manual}
    fake["metadata"]["ownerReferences"] = [{
        "apiVersion": api.API_VERSION, "kind": api.SANDBOX_KIND, "name": name,
        "uid": owner["metadata"]["uid"]}]
    kube.create_pod(namespace, fake)

    def refused() -> str | None:
        phase = sb.pod_annotation(kube, namespace, "fake-restore",
                                  protocol.ANNOTATION_RESTORE_PHASE)
        assert phase in (None, protocol.RESTORE_FAILED), f"a restore started: {phase}"
        return sb.pod_annotation(kube, namespace, "fake-restore",
                                 protocol.ANNOTATION_RESTORE_MESSAGE) if phase else None

    message = wait_until("the fake pod's restore refused", 90, refused)
    print(f"\nrefused: {message}")
    assert "only the operator's pods are restored" in message, message
    assert sb.pod_annotation(kube, namespace, "fake-restore",
                             protocol.ANNOTATION_RESTORE_RETRYABLE) == "false"
    wait_until("a RestoreRefused Event", 30, lambda: any(
        e["reason"] == "RestoreRefused" for e in sb.events(kube, namespace, "fake-restore")))
    pod = kube.pod(namespace, "fake-restore") or {}
    assert pod.get("status", {}).get("phase") == "Running", "its own process runs on"
    assert sb.status(namespace, name)["podName"] == where.pod, "the sandbox is untouched"
    attack.record("pod faked with the sandbox label and a restore-from",
                  tried=f"a pod on {where.node} labelled as {name}'s, owned by its uid, "
                        f"hermit.dev/restore-from: {manual} (Completed, verified)",
                  outcome=REFUSED,
                  evidence=f"restore-phase Failed, not retryable: {message[:120]}; a "
                           "RestoreRefused Event; nothing restored into it")


# -- issue 17.3: a node decrypts only what it serves (the key service) ----------------------

# Run inside a node-agent pod, with its own settings and its own projected token: unwrap
# the sandbox's stored data key through the key service, as its store would.
_UNWRAP = r'''
import base64, os
from hermit_common.keyclient import KeyAccessDenied
from hermit_common.seal import Context, Wrapped, sealing_from
from hermit_common.settings import SealSettings
sealing = sealing_from(SealSettings.from_env(os.environ))
record = Wrapped.from_bytes(base64.b64decode("{record}"))
context = Context("{ns}", "{name}", "{uid}", lineage=record.lineage)
try:
    print("UNWRAPPED", len(sealing.wrapper.unwrap(record, context.sandbox_bytes())))
except KeyAccessDenied as exc:
    print("DENIED", exc)
'''


def _key_record(s3: S3, ns: str, name: str, uid: str) -> bytes:
    import boto3

    s3c = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=s3.access_key,
                       aws_secret_access_key=s3.secret_key, region_name="us-east-1")
    keys = [o["Key"] for page in s3c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
            for o in page.get("Contents", [])
            if f"/{ns}/" in f"/{o['Key']}" and o["Key"].endswith(f"/keys/{uid}")]
    assert len(keys) == 1, f"the key record of {ns}/{name}: {keys}"
    return bytes(s3c.get_object(Bucket=BUCKET, Key=keys[0])["Body"].read())


@pytest.mark.attack
def test_a_node_agent_gets_no_key_of_a_sandbox_on_another_node_and_mounts_no_kek(
        kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig,
        s3_for_pods: S3, attack: Attack) -> None:
    """With the key service (nodeAgent.sealing.keyService), the node-agent of the node a
    sandbox runs on unwraps its stored data key; the node-agent of another node, asking
    with its own token from inside its own pod, is refused; no node-agent pod mounts the
    sealing Secret or holds a key-encryption key under /etc or /var/run/secrets (the
    node's own files are not looked at: a node that runs the operator's pod holds its
    Secret volumes, docs/security.md)."""
    import base64

    name, where = sb.start_on_spot(kube, e2e_config, hermit_release, namespace)
    sb.checkpoint_now(namespace, name, f"{name}-keys")  # writes the sandbox's key record
    uid = str(sb.sandbox(namespace, name)["metadata"]["uid"])
    record = _key_record(s3_for_pods, namespace, name, uid)
    script = _UNWRAP.format(record=base64.b64encode(record).decode(), ns=namespace,
                            name=name, uid=uid)
    agents = {p.spec.node_name: p for p in kube.api.list_namespaced_pod(
        RELEASE_NS, label_selector="app.kubernetes.io/component=node-agent").items
        if p.status.phase == "Running" and p.spec.node_name}
    others = sorted(n for n in agents if n != where.node)
    assert where.node in agents and others, f"needs node-agents on two nodes: {sorted(agents)}"

    def unwrap_from(node: str) -> str:
        return sb.exec_sh(RELEASE_NS, agents[node].metadata.name,
                          f"python3 - <<'EOF'\n{script}\nEOF").strip()

    mine = unwrap_from(where.node)
    assert mine == "UNWRAPPED 32", mine
    theirs = unwrap_from(others[0])
    print(f"\n{where.node}: {mine}\n{others[0]}: {theirs[:300]}")
    assert theirs.startswith("DENIED") and \
        f"node {others[0]} neither runs nor restores sandbox {namespace}/{name}" in theirs, \
        theirs

    # No node-agent holds a KEK: no Secret volume of the sealing Secret, and none of its
    # key values in any file the pod sees under /etc or /var/run.
    [sealing] = [s for s in kube.api.list_namespaced_secret(RELEASE_NS).items
                 if s.metadata.name.endswith("-sealing")]
    keks = [base64.b64decode(v).decode() for k, v in (sealing.data or {}).items()
            if k != "current"]
    assert keks
    for node, pod in sorted(agents.items()):
        secrets = {v.secret.secret_name for v in pod.spec.volumes or [] if v.secret}
        assert sealing.metadata.name not in secrets, (node, secrets)
        env = {e.name for c in pod.spec.containers for e in c.env or []}
        assert "HERMIT_SEAL_KEYS_DIR" not in env and "HERMIT_SEAL_KEY_SERVICE_URL" in env
        found = sb.exec_sh(RELEASE_NS, pod.metadata.name, "; ".join(
            f"grep -rlsF -D skip '{k}' /etc /var/run/secrets 2>/dev/null" for k in keks)
            + "; echo END")
        assert found.strip() == "END", f"{node}: a KEK in {found}"
    attack.record(
        "key service: a node asks for another node's sandbox key",
        tried=f"exec in the node-agent pod of {others[0]}: its own projected token "
              f"(audience hermit.dev/keys) unwraps the stored data key of {namespace}/{name}, "
              f"which runs on {where.node}",
        outcome=REFUSED,
        evidence=f"{theirs[:160]}; the node-agent of {where.node} unwraps it; no node-agent "
                 f"pod ({len(agents)}) mounts the sealing Secret or has a KEK under /etc, "
                 "/var/run/secrets")


# -- issue 17.3: a node reaches only the bucket prefixes it serves (scoped credentials) ----

# Run inside a node-agent pod with whatever it holds: its environment (no bucket
# credential), the SDK's default chain, and what the key service vends to its own token.
_STORE_PROBE = r'''
import dataclasses, json, os
from botocore.exceptions import ClientError, NoCredentialsError
from hermit_common.keyclient import RemoteKeyWrapper
from hermit_common.seal import sealing_from
from hermit_common.settings import SealSettings, StoreSettings
from hermit_common.store import make_s3_client
from hermit_common.storecreds import StoreCredentialsUnavailable

store = StoreSettings.from_env(os.environ)
ns, own, victim, uid = "{ns}", "{own}", "{victim}", "{uid}"
base = f"{{store.prefix}}/{{ns}}"
victim_key = f"{{base}}/{{victim}}/keys/{{uid}}"
own_key = f"{{base}}/{{own}}/chunks/" + "e2e" * 20 + "abcd"
out = {{"env": sorted(k for k in os.environ if k.startswith(("HERMIT_S3_ACCESS",
                                                            "HERMIT_S3_SECRET", "AWS_")))}}

def code(call):
    try:
        call()
        return "allowed"
    except ClientError as exc:
        return exc.response.get("Error", {{}}).get("Code", "?")
    except NoCredentialsError:
        return "NoCredentials"

def attempts(s3):
    b = store.bucket
    return {{"read": code(lambda: s3.get_object(Bucket=b, Key=victim_key)),
             "list": code(lambda: s3.list_objects_v2(Bucket=b, Prefix=f"{{base}}/{{victim}}/")),
             "list the bucket": code(lambda: s3.list_objects_v2(Bucket=b)),
             "overwrite": code(lambda: s3.put_object(Bucket=b, Key=victim_key, Body=b"forged")),
             "delete": code(lambda: s3.delete_object(Bucket=b, Key=victim_key))}}

out["default chain"] = attempts(make_s3_client(store))
wrapper = sealing_from(SealSettings.from_env(os.environ)).wrapper
assert isinstance(wrapper, RemoteKeyWrapper)
try:
    wrapper.store_credentials(ns, victim)
    out["victim credentials"] = "GIVEN"
except StoreCredentialsUnavailable as exc:
    out["victim credentials"] = "DENIED " + str(exc)
creds = wrapper.store_credentials(ns, own)
mine = make_s3_client(dataclasses.replace(
    store, access_key_id=creds.access_key_id, secret_access_key=creds.secret_access_key,
    session_token=creds.session_token))
out["own credentials"] = attempts(mine)
b = store.bucket
out["own prefix"] = {{
    "write": code(lambda: mine.put_object(Bucket=b, Key=own_key, Body=b"mine")),
    "read": code(lambda: mine.get_object(Bucket=b, Key=own_key)),
    "list": code(lambda: mine.list_objects_v2(Bucket=b, Prefix=f"{{base}}/{{own}}/")),
    "delete": code(lambda: mine.delete_object(Bucket=b, Key=own_key))}}
print("RESULT " + json.dumps(out))
'''


@pytest.mark.attack
def test_a_node_agents_store_credentials_reach_only_its_own_sandboxs_objects(
        kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig,
        s3_for_pods: S3, attack: Attack) -> None:
    """With scoped store credentials (the chart's default with the key service), a
    node-agent holds no bucket credential; from inside its pod, with what it holds and
    what the key service vends it for the sandbox its node runs, another node's sandbox's
    objects are refused (read, list, overwrite, delete), and its own are not."""
    import json

    victim, where = sb.start_on_spot(kube, e2e_config, hermit_release, namespace)
    # Its checkpoint is written by the node-agent of its node with scoped credentials.
    sb.checkpoint_now(namespace, victim, f"{victim}-scoped")
    uid = str(sb.sandbox(namespace, victim)["metadata"]["uid"])
    before = _key_record(s3_for_pods, namespace, victim, uid)
    # A second sandbox, kept off the victim's node: its node-agent is the attacker.
    own = f"agent-{uuid.uuid4().hex[:6]}"
    spec = sb.stateful_spec(e2e_config.sandbox_image)
    spec["podTemplate"]["spec"]["affinity"] = {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn",
                                   "values": [where.node]}]}]}}}
    sb.create_sandbox(namespace, own, spec)
    there = sb.wait_running(kube, namespace, own, min_ticks=2)
    assert there.node != where.node
    sb.wait_agent_ready(kube, hermit_release, there.node)
    agent = sb.node_agent_pod(kube, RELEASE_NS, there.node)
    env = {e.name for c in agent.spec.containers for e in c.env or []}
    assert "HERMIT_S3_SCOPED_CREDENTIALS" in env and "HERMIT_S3_ACCESS_KEY_ID" not in env
    script = _STORE_PROBE.format(ns=namespace, own=own, victim=victim, uid=uid)
    printed = sb.exec_sh(RELEASE_NS, agent.metadata.name, f"python3 - <<'EOF'\n{script}\nEOF")
    [line] = [x for x in printed.splitlines() if x.startswith("RESULT ")]
    out = json.loads(line[len("RESULT "):])
    print(f"\nnode-agent of {there.node} against {victim} (on {where.node}): {out}")
    assert out["env"] == [], out["env"]
    assert "allowed" not in out["default chain"].values(), out["default chain"]
    assert out["victim credentials"].startswith("DENIED") and \
        f"neither runs nor restores sandbox {namespace}/{victim}" in out["victim credentials"]
    assert out["own credentials"] == dict.fromkeys(out["own credentials"], "AccessDenied")
    assert out["own prefix"] == dict.fromkeys(("write", "read", "list", "delete"), "allowed")
    assert _key_record(s3_for_pods, namespace, victim, uid) == before, "untouched"
    attack.record(
        "scoped store credentials: a node reads, lists, overwrites another node's sandbox",
        tried=f"exec in the node-agent pod of {there.node}: its environment, the SDK's "
              f"default chain, and the STS credentials the key service vends its own token "
              f"for {own} (on {there.node}) against the key record of {namespace}/{victim} "
              f"(on {where.node}): read, list, list the bucket, overwrite, delete; and "
              f"asks the key service for {victim}'s credentials",
        outcome=REFUSED,
        evidence=f"no bucket credential in its env; default chain: "
                 f"{sorted(set(out['default chain'].values()))}; {victim}'s credentials: "
                 f"{out['victim credentials'][:90]}; with {own}'s: AccessDenied x5; own "
                 "prefix write/read/list/delete allowed; the key record unchanged")
