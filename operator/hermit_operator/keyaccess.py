"""Who may use which sandbox's keys at the key service (keyservice.py): pure functions.

A node-agent authenticates with a projected service-account token of the key service's
audience, bound to its pod; the TokenReview names its service account and the node
the pod runs on (``status.user.extra["authentication.kubernetes.io/node-name"]``, set
for pod-bound tokens since Kubernetes 1.30). ``caller_of`` turns a review into a
``Caller`` (the node) or a refusal.

A node serves a sandbox (namespace, name, uid) when either

- a sandbox pod bound to the node (``spec.nodeName``) is the operator's pod of that
  sandbox (``operators_pod``): labelled ``hermit.dev/sandbox: <name>``, controlled by
  the AgentSandbox ``<name>`` with that uid, named ``<name>-<incarnation>`` and of the
  incarnation the sandbox's status names, or the one before or after it (a kubelet
  cannot make a pod with such an owner: the NodeRestriction admission plugin refuses
  it), or
- such a pod (of another sandbox) restores from a Checkpoint (``hermit.dev/restore-from``)
  of that sandbox: a fork or copy reads, and inherits, its source's data key.

Everything else is refused (``Denied``): a compromised node gets no key of a sandbox it
neither runs nor restores (docs/security.md#the-key-service). ``decide`` says which of
the two it is (``RUNS`` or ``RESTORES``): data keys are given for both; scoped store
credentials (docs/storage.md#scoped-store-credentials) reach the prefix of a sandbox the
node runs read-write, of one it only restores from read-only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from hermit_common import api, protocol
from hermit_common.seal import Bound

NODE_NAME_EXTRA: Final = "authentication.kubernetes.io/node-name"

# Why a request was refused: the metric's label values (a small, fixed set).
UNAUTHENTICATED: Final = "unauthenticated"
NOT_A_NODE_AGENT: Final = "not_node_agent"
NO_NODE: Final = "no_node_binding"
NOT_SERVED: Final = "not_served"
DENIALS: Final = (UNAUTHENTICATED, NOT_A_NODE_AGENT, NO_NODE, NOT_SERVED)

# What ``decide`` allows.
RUNS: Final = "runs"  # an operator-made pod of the sandbox is on the node
RESTORES: Final = "restores"  # such a pod of another sandbox restores from its checkpoint


class Denied(Exception):
    """Refused: ``status`` (401, 403), ``reason`` (DENIALS) and a one-line message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason = status, reason


@dataclass(frozen=True)
class Caller:
    username: str
    node: str


def caller_of(review: Mapping[str, Any], callers: Iterable[str], audience: str) -> Caller:
    """The caller a TokenReview's status names: authenticated for ``audience``, one of
    ``callers`` (service-account usernames) and bound to a node. Denied otherwise."""
    # The status must name our audience (the TokenReview API's advice: a server that
    # ignores spec.audiences would otherwise pass any token).
    if not review.get("authenticated") or audience not in (review.get("audiences") or ()):
        raise Denied(401, UNAUTHENTICATED, f"the token is not a valid service-account token "
                                           f"for the audience {audience}")
    user = review.get("user") or {}
    username = str(user.get("username") or "")
    if username not in set(callers):
        raise Denied(403, NOT_A_NODE_AGENT, f"{username or 'the caller'} is not a Hermit "
                                            "node-agent: only node-agents use the key service")
    nodes = (user.get("extra") or {}).get(NODE_NAME_EXTRA) or []
    if not isinstance(nodes, list) or len(nodes) != 1 or not isinstance(nodes[0], str) \
            or not nodes[0]:
        raise Denied(403, NO_NODE, "the token is not bound to a pod on a node (a projected "
                                   "token of the node-agent's pod is needed)")
    return Caller(username, nodes[0])


@dataclass(frozen=True)
class NodePod:
    """A sandbox pod as authorisation sees it."""

    namespace: str
    name: str
    node: str
    sandbox: Bound | None  # the sandbox it is (None: not a well-formed sandbox pod)
    incarnation: int | None
    restore_from: str | None  # the Checkpoint it restores from


def node_pod(pod: Mapping[str, Any]) -> NodePod:
    meta = protocol.meta(pod)
    namespace = str(meta.get("namespace") or "")
    name = (meta.get("labels") or {}).get(protocol.LABEL_SANDBOX)
    owner = next((o for o in meta.get("ownerReferences") or []
                  if o.get("kind") == api.SANDBOX_KIND and o.get("controller") is True
                  and str(o.get("apiVersion") or "").startswith(f"{api.GROUP}/")), None)
    sandbox = None
    if name and owner is not None and owner.get("name") == name and owner.get("uid"):
        sandbox = Bound(namespace, str(name), str(owner["uid"]))
    restore = (meta.get("annotations") or {}).get(protocol.ANNOTATION_RESTORE_FROM)
    return NodePod(namespace, str(meta.get("name") or ""),
                   str((pod.get("spec") or {}).get("nodeName") or ""), sandbox,
                   protocol.incarnation_of(pod), str(restore) if restore else None)


def operators_pod(pod: NodePod, sandbox: Mapping[str, Any] | None) -> bool:
    """Whether ``pod`` is one the operator made for ``sandbox`` (the AgentSandbox as read
    now) and that may still checkpoint or restore it: owned by its uid, named as the
    operator names the pod of its incarnation label, and that incarnation the one the
    sandbox's status names, the next (a move's replacement, created before the status
    names it) or the previous (the pod a move leaves, finishing its checkpoint and
    garbage collection). Anyone who may create pods in the namespace can copy a label
    and an owner reference; only the operator writes the status, and a pod's name is
    unique."""
    if pod.sandbox is None or pod.incarnation is None or sandbox is None:
        return False
    meta = protocol.meta(sandbox)
    if meta.get("uid") != pod.sandbox.sandbox_uid or meta.get("name") != pod.sandbox.sandbox:
        return False
    try:
        current = int((sandbox.get("status") or {}).get("incarnation") or 0)
    except (TypeError, ValueError):
        return False
    return pod.name == f"{pod.sandbox.sandbox}-{pod.incarnation}" \
        and abs(pod.incarnation - current) <= 1


# (namespace, name) -> the object as read now, or None
Read = Callable[[str, str], Mapping[str, Any] | None]


def decide(node: str, want: Bound, pods: Iterable[Mapping[str, Any]], *,
           sandbox_of: Read, checkpoint_of: Read) -> str:
    """How ``node`` serves ``want`` (see the module): RUNS or RESTORES; Denied(403) when
    it does not.
    Only the node's pods in the wanted sandbox's namespace are looked at, and only the
    objects they name are read."""
    mine = [p for p in map(node_pod, pods)
            if p.node == node and p.sandbox is not None and p.namespace == want.namespace]
    sandboxes: dict[str, Mapping[str, Any] | None] = {}

    def operated(pod: NodePod) -> bool:
        assert pod.sandbox is not None
        if pod.sandbox.sandbox not in sandboxes:
            sandboxes[pod.sandbox.sandbox] = sandbox_of(want.namespace, pod.sandbox.sandbox)
        return operators_pod(pod, sandboxes[pod.sandbox.sandbox])

    if any(p.sandbox == want and operated(p) for p in mine):
        return RUNS
    for pod in mine:
        if pod.restore_from and pod.sandbox != want and operated(pod):
            ckpt = checkpoint_of(want.namespace, pod.restore_from)
            source = protocol.sandbox_of(ckpt) if ckpt is not None else None
            if source == want.sandbox and source_bound(
                    ckpt, sandbox_of(want.namespace, source)) == want:
                return RESTORES
    raise Denied(403, NOT_SERVED, f"node {node} neither runs nor restores {want.describe()}: "
                                  "its keys are not given to this node")


def source_bound(checkpoint: Mapping[str, Any] | None,
                 sandbox: Mapping[str, Any] | None) -> Bound | None:
    """The sandbox a Checkpoint is of, given that AgentSandbox as read now (its uid binds
    the checkpoint, as the node-agent's restore binds it); None when either is missing."""
    if checkpoint is None or sandbox is None:
        return None
    name = protocol.sandbox_of(checkpoint)
    meta = protocol.meta(sandbox)
    if not name or meta.get("name") != name or not meta.get("uid"):
        return None
    return Bound(str(protocol.meta(checkpoint).get("namespace") or ""), name,
                 str(meta["uid"]))
