"""Autoscalers empty a node that runs a sandbox, and the sandbox moves with its memory.

Real Karpenter against a cloud provider for this cluster is out of reach here, so each test
does to a node exactly what the autoscaler's own code does when it removes one (read from
their sources):

- Karpenter (consolidation, drift, expiry: the disruption controller, then the termination
  controller): a node is a candidate only when no pod on it has
  ``karpenter.sh/do-not-disrupt: "true"`` or is covered by a PodDisruptionBudget that
  allows no disruption; it is tainted ``karpenter.sh/disrupted:NoSchedule``, then every pod
  but DaemonSets' is evicted through the Eviction API, a 429 (a budget) requeued with a
  backoff, until none is left; then the instance is deleted.
- The cluster autoscaler's scale-down: a node is a candidate only when every pod on it is
  drainable: not blocked by a budget; with local storage (an emptyDir) or a controller it
  does not know (an AgentSandbox), only with ``cluster-autoscaler.kubernetes.io/
  safe-to-evict: "true"``; it is tainted ``ToBeDeletedByClusterAutoscaler=<unix time>:
  NoSchedule``, each pod evicted with a grace period of min(its own, 600 s), a failed
  eviction retried every 10 s for at most 2 min, then the pods are waited for (their
  grace period plus 30 s) and the instance is deleted.
- A bare eviction (the descheduler, a script): no taint, no cordon; the node-agent acts on
  the pod's deletion alone, while its preStop hook holds it.

In each case the eviction must be accepted at once (not 429), the pod's termination must
wait for its durable Eviction checkpoint (held by its preStop hook's sleep, which the
operator cuts short once the sandbox has moved: docs/protocol.md "Evictions"), the
sandbox must run on elsewhere with its counter continuing exactly (no tick lost, none
repeated), and the node must end with DaemonSet pods only, so that the autoscaler can
delete it, which the test then does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hermit_common import api, protocol
from tests.e2e import sandboxes as sb
from tests.e2e.cluster import RELEASE_NS, E2EConfig, Kube, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

Obj = dict[str, Any]
KARPENTER_TAINT = {"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}
CA_TAINT = "ToBeDeletedByClusterAutoscaler"
CA_MAX_GRACEFUL_TERMINATION = 600
CA_EVICTION_RETRY = 10.0
CA_MAX_POD_EVICTION = 120.0
CA_POD_EVICTION_HEADROOM = 30.0
EMPTY_DIR_SAFE = "cluster-autoscaler.kubernetes.io/safe-to-evict"
DO_NOT_DISRUPT = "karpenter.sh/do-not-disrupt"


def _pods_on(kube: Kube, node: str) -> list[Any]:
    return list(kube.api.list_pod_for_all_namespaces(
        field_selector=f"spec.nodeName={node}").items)


def _daemonset_pod(pod: Any) -> bool:
    return any(o.kind == "DaemonSet" for o in pod.metadata.owner_references or [])


def _blocking_budgets(pod: Any) -> list[str]:
    """The PodDisruptionBudgets covering ``pod`` that allow no disruption now (what both
    autoscalers check before they pick a node)."""
    budgets = client.PolicyV1Api().list_namespaced_pod_disruption_budget(
        pod.metadata.namespace).items
    labels = pod.metadata.labels or {}
    out = []
    for pdb in budgets:
        match = (pdb.spec.selector.match_labels or {}) if pdb.spec.selector else {}
        if match.items() <= labels.items() and (pdb.status is None
                                                or not pdb.status.disruptions_allowed):
            out.append(pdb.metadata.name)
    return out


def candidate_refusals(kube: Kube, node: str, autoscaler: str) -> list[str]:
    """Why the autoscaler's own rules would not choose ``node`` (empty: it would)."""
    why = []
    for pod in _pods_on(kube, node):
        # Both skip DaemonSet pods, finished pods and pods being deleted already.
        if (_daemonset_pod(pod) or pod.status.phase in ("Succeeded", "Failed")
                or pod.metadata.deletion_timestamp is not None):
            continue
        name = f"{pod.metadata.namespace}/{pod.metadata.name}"
        annotations = pod.metadata.annotations or {}
        why += [f"{name}: PodDisruptionBudget {b} allows no disruption"
                for b in _blocking_budgets(pod)]
        if autoscaler == "karpenter" and annotations.get(DO_NOT_DISRUPT) == "true":
            why.append(f"{name}: {DO_NOT_DISRUPT}")
        local = any(v.empty_dir is not None for v in pod.spec.volumes or [])
        custom = any(o.controller and o.kind not in ("ReplicaSet", "StatefulSet", "Job",
                                                     "ReplicationController")
                     for o in pod.metadata.owner_references or [])
        if (autoscaler == "cluster-autoscaler" and (local or custom)
                and annotations.get(EMPTY_DIR_SAFE) != "true"):
            why.append(f"{name}: local storage or a custom controller without "
                       f"{EMPTY_DIR_SAFE}: true")
    return why


def taint(kube: Kube, node: str, new: Obj) -> None:
    current = kube.api.read_node(node)
    taints = [t for t in (current.spec.taints or []) if t.key != new["key"]]
    kube.api.patch_node(node, {"spec": {"taints": [
        *[{"key": t.key, "value": t.value, "effect": t.effect} for t in taints], new]}})


def untaint(kube: Kube, node: str, key: str) -> None:
    """Cleanup: the taint removed again (when the node still exists)."""
    try:
        current = kube.api.read_node(node)
    except ApiException:
        return
    kube.api.patch_node(node, {"spec": {"taints": [
        {"key": t.key, "value": t.value, "effect": t.effect}
        for t in current.spec.taints or [] if t.key != key] or None}})


NAMESPACE_TERMINATING = "NamespaceTerminating"


def evict(kube: Kube, pod: Any, grace: int | None) -> int:
    """One call of the Eviction API: its HTTP status (201 accepted, 429 refused, 403 when
    the pod's namespace is being deleted: its deletion removes the pod soon)."""
    body = client.V1Eviction(
        metadata=client.V1ObjectMeta(name=pod.metadata.name, namespace=pod.metadata.namespace),
        delete_options=None if grace is None else client.V1DeleteOptions(
            grace_period_seconds=grace))
    try:
        kube.api.create_namespaced_pod_eviction(pod.metadata.name, pod.metadata.namespace, body)
        return 201
    except ApiException as exc:
        if exc.status == 404:
            return 404  # gone meanwhile: what both autoscalers count as done
        if exc.status == 429:
            return 429
        if exc.status == 403 and NAMESPACE_TERMINATING in (exc.body or ""):
            return 403  # an earlier test's namespace, going: retried until the pod is gone
        raise


def evict_like(kube: Kube, node: str, autoscaler: str) -> dict[str, list[int]]:
    """Every pod on ``node`` but DaemonSets' evicted as the autoscaler does it: all at once
    (both evict a node's pods in parallel), then 429s (and 403s of a namespace being
    deleted) retried as they retry failed evictions; the answers, per pod."""
    answers: dict[str, list[int]] = {}
    # Pods being deleted already (an earlier test's, its namespace going) are going anyway.
    pending = [p for p in _pods_on(kube, node) if not _daemonset_pod(p)
               and p.status.phase not in ("Succeeded", "Failed")
               and p.metadata.deletion_timestamp is None]
    deadline = time.monotonic() + CA_MAX_POD_EVICTION
    backoff = 1.0
    while True:
        refused = []
        for pod in pending:
            grace = None
            if autoscaler == "cluster-autoscaler":
                grace = min(pod.spec.termination_grace_period_seconds or 30,
                            CA_MAX_GRACEFUL_TERMINATION)
            status = evict(kube, pod, grace)
            answers.setdefault(f"{pod.metadata.namespace}/{pod.metadata.name}",
                               []).append(status)
            if status in (429, 403):
                refused.append(pod)
        pending = refused
        if not pending or time.monotonic() > deadline:
            return answers
        # Karpenter's queue backs off exponentially; the CA retries every 10 s.
        time.sleep(CA_EVICTION_RETRY if autoscaler == "cluster-autoscaler" else backoff)
        backoff = min(backoff * 2, 10.0)


def only_daemonsets_left(kube: Kube, node: str) -> Callable[[], list[str] | None]:
    def probe() -> list[str] | None:
        pods = _pods_on(kube, node)
        left = [p.metadata.name for p in pods if not _daemonset_pod(p)]
        return None if left else sorted(p.metadata.name for p in pods)
    return probe


@pytest.mark.parametrize("autoscaler", ["karpenter", "cluster-autoscaler", "bare-eviction"])
def test_an_autoscaler_empties_a_node_and_the_sandbox_moves_with_its_memory(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig, autoscaler: str,
) -> None:
    name, where = sb.start_on_spot(kube, e2e_config, hermit_release, namespace)
    node = where.node
    # The node is a candidate by the autoscaler's own rules (before this change the
    # sandbox's PodDisruptionBudget kept it, and the node, forever).
    assert candidate_refusals(kube, node, autoscaler) == []
    assert candidate_refusals(kube, node, "cluster-autoscaler" if autoscaler == "karpenter"
                              else "karpenter") == []
    started = time.monotonic()
    new_taint = None
    if autoscaler == "karpenter":
        new_taint = KARPENTER_TAINT
    elif autoscaler == "cluster-autoscaler":
        new_taint = {"key": CA_TAINT, "value": str(int(time.time())), "effect": "NoSchedule"}
    moved = False
    try:
        if new_taint is not None:
            taint(kube, node, new_taint)
        outcome = _evict_and_follow(kube, e2e_config, namespace, name, where, autoscaler,
                                    started)
        moved = True
    finally:
        if new_taint is not None and not moved:
            untaint(kube, node, new_taint["key"])  # the node stays usable for other tests
    if new_taint is not None:
        sb.lose_node(e2e_config, node, timeout=120)  # the autoscaler deletes the instance
    print(f"{autoscaler}: {outcome}")


def _evict_and_follow(kube: Kube, cfg: E2EConfig, namespace: str, name: str,
                      where: sb.Running, autoscaler: str, started: float) -> str:
    """Evicts the node's pods as ``autoscaler`` does and follows the sandbox to its next
    node; fails unless the eviction was accepted at once, the pod was held until its
    Eviction checkpoint was durable, and the sandbox continues exactly; a summary."""
    node = where.node
    old = sb.LastTick(kube, namespace, where.pod)
    # The pod is being deleted, and stays (its tree running, then frozen under the
    # checkpoint) until its Eviction checkpoint is durable. Watched from before the
    # eviction on: the hold can end (2 s) before the retries of other pods' refused
    # evictions do.
    seen: dict[str, Any] = {"deleting": False, "gone_early": False}

    def held_until_durable() -> Obj | None:
        pod = kube.pod(namespace, where.pod)
        done = sb.completed_checkpoint(namespace, "Eviction", sandbox_name=name)()
        if pod is None and done is None:
            seen["gone_early"] = True
        elif pod is not None and pod["metadata"].get("deletionTimestamp"):
            seen["deleting"] = True
        return done

    with ThreadPoolExecutor(1) as follower:
        reading = follower.submit(sb.durable_reading, "a Completed Eviction checkpoint", 120,
                                  held_until_durable, [old], 0.1)
        answers = evict_like(kube, node, autoscaler)
        assert answers[f"{namespace}/{where.pod}"] == [201], (
            f"the eviction of the sandbox's pod was not accepted at once: {answers}")
        ckpt = reading.result()
    durable = sb.since(started)
    assert seen["deleting"] and not seen["gone_early"], seen
    assert ckpt["metadata"]["labels"][protocol.LABEL_INCARNATION] == "1"
    last = old.final()
    if autoscaler == "bare-eviction":  # only the hold told the node-agent
        log = sb.node_agent_log(kube, RELEASE_NS, node)
        assert (f"pod {namespace}/{where.pod} is being deleted: its termination waits"
                in log), log[-3000:]
    # Once the sandbox moved, the operator cuts the hold's sleep short: the old pod goes
    # long before its grace period (120 s) would have ended it.
    wait_until(f"pod {where.pod} gone", 60, lambda: kube.pod(namespace, where.pod) is None)
    left: list[str] = []
    if autoscaler != "bare-eviction":
        # The node empties: the autoscaler waits for that, then deletes the instance.
        grace = CA_MAX_GRACEFUL_TERMINATION + CA_POD_EVICTION_HEADROOM
        left = wait_until(f"only DaemonSet pods on {node}", grace,
                          only_daemonsets_left(kube, node))
    emptied = sb.since(started)
    after = sb.wait_running(kube, namespace, name, restores=1, min_ticks=1,
                            avoid=node if autoscaler != "bare-eviction" else "")
    assert after.pod != where.pod
    sb.assert_continues(kube, namespace, after.pod, last, exact=True)
    status = sb.status(namespace, name)
    assert status["restoredFrom"]["name"] == ckpt["metadata"]["name"], status["restoredFrom"]
    assert status["restoredFrom"]["staleSeconds"] == 0, status["restoredFrom"]
    # A kubelet whose copy of the Node lags the node-agent's ready label may refuse the
    # first pod bound there (NodeAffinity); the operator replaces it with a Normal
    # PodRejected Event (docs/architecture.md). A lossless move brings no Warning at all.
    warnings = [e for e in sb.events(kube, namespace, name) if e["type"] == "Warning"]
    assert not warnings, f"an eviction that lost nothing warned: {warnings}"
    return (f"eviction accepted; Eviction checkpoint {ckpt['metadata']['name']} durable "
            f"{durable} s after the eviction began; old pod gone and {node} left with "
            f"{left or 'its pods'} after {emptied} s; sandbox running on {after.node} "
            f"({after.pod}) from tick {last + 1}")


@pytest.mark.parametrize("propagation", ["Background", "Foreground"])
def test_deleting_an_agentsandbox_ends_its_held_pod_at_once(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig, propagation: str,
) -> None:
    """A deleted AgentSandbox's pod has nothing left to save: the operator removes it at
    once instead of leaving its preStop sleep to hold it for its whole grace period (which
    kept an earlier test's pod on a node the next test emptied). Under a foreground delete
    the AgentSandbox waits for its pods, and gets no new one meanwhile."""
    name, where = sb.start_on_spot(kube, e2e_config, hermit_release, namespace)
    pod = kube.api.read_namespaced_pod(where.pod, namespace)
    annotations = pod.metadata.annotations or {}
    assert annotations.get(protocol.ANNOTATION_HOLD) == "true", annotations
    grace = pod.spec.termination_grace_period_seconds or 0
    assert grace >= 60, f"the hold's grace period is {grace}s"
    sb.custom().delete_namespaced_custom_object(
        api.GROUP, api.VERSION, namespace, api.SANDBOX_PLURAL, name,
        body=client.V1DeleteOptions(propagation_policy=propagation))
    deleted = time.monotonic()

    def sandbox_gone() -> bool:
        try:
            sb.sandbox(namespace, name)
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return False

    def all_gone() -> bool | None:
        pods = kube.api.list_namespaced_pod(
            namespace, label_selector=f"{protocol.LABEL_SANDBOX}={name}").items
        return (not pods and sandbox_gone()) or None

    wait_until(f"AgentSandbox {name} and its pods gone", grace / 2, all_gone, 0.2)
    gone = sb.since(deleted)
    created = [e for e in sb.events(kube, namespace, name)
               if e["reason"] == api.REASON_POD_LOST or (
                   e["reason"] == api.REASON_POD_CREATING
                   and where.pod not in (e["message"] or ""))]
    assert not created, f"a pod was created for the sandbox being deleted: {created}"
    print(f"{propagation} delete: the sandbox and its held pod gone after {gone} s "
          f"(grace period {grace} s)")
