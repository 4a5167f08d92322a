"""The Checkpoints a node-agent creates itself (Preemption, Eviction, Rebalance, Turn), and
what it does when another node took the name first.

A request's name is ``protocol.checkpoint_name`` of its pod's sandbox, incarnation and
reason: deterministic, so a loop that runs again (or an agent that restarted) finds its own
request instead of making a second. Deterministic also means guessable: any node-agent may
create Checkpoints (labelled with its own node, the API server's policy says), so a
compromised node could create ``box-3-preempt`` before the node that runs ``box`` gets its
notice, and that node's create would answer AlreadyExists with someone else's object.

So an answer that is not this node's own request (another node's label, or another
sandbox, incarnation or reason) does not count: the request is made again under the same
name with a tag appended, 8 hex digits of an HMAC under a key this process drew at random
(``unsquatted``). No other node knows the key, so none can take that name too; the
policy's name pattern (protocol.NODE_AGENT_CHECKPOINT_NAMES) allows the tag. The squatter's
object is ignored and failed by the operator (it is labelled with a node the sandbox does
not run on). The planner finds requests by their labels, not their names
(planner.stop_requests), so a tagged request is found again on the next loop; after a
restart the key differs, but the request made before is found by its labels all the same.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from typing import Any, Final, Protocol

from hermit_common import protocol
from hermit_common.errors import HermitError
from hermit_common.protocol import KubeObject
from hermit_node.control.planner import CheckpointView, SandboxPod

# Drawn once per process: the tag of a name another node took first.
_KEY: Final = secrets.token_bytes(32)
TAG_HEX: Final = 8


class RequestKube(Protocol):
    def create_checkpoint(self, manifest: KubeObject,
                          namespace: str | None = None) -> KubeObject: ...


class NameTaken(HermitError):
    """Both the protocol's name and the tagged one are held by Checkpoints not this node's."""


def own_request(ckpt: Mapping[str, Any], sp: SandboxPod, reason: str, node: str) -> bool:
    """Whether ``ckpt`` (what a create answered, maybe an object that existed) is this node's
    request of ``reason`` for ``sp``'s incarnation."""
    view = CheckpointView.from_object(ckpt)
    return view.node == node and view.of_incarnation(sp) and view.reason == reason


def tag(namespace: str, name: str, key: bytes = _KEY) -> str:
    """The secret tag of a request name another node took: the same for the same name in
    this process, unknowable elsewhere."""
    digest = hmac.new(key, f"{namespace}/{name}".encode(), hashlib.sha256).hexdigest()
    return digest[:TAG_HEX]


def unsquatted(sp: SandboxPod, reason: str, name_tag: str, key: bytes = _KEY) -> str:
    """The name of the request when its protocol name (``name_tag``: ``-r2``, a turn's
    number) is held by a Checkpoint that is not this node's."""
    plain = protocol.checkpoint_name(sp.sandbox, sp.incarnation, reason, name_tag)
    return protocol.checkpoint_name(sp.sandbox, sp.incarnation, reason,
                                    f"{name_tag}-{tag(sp.namespace, plain, key)}")


def create(kube: RequestKube, sp: SandboxPod, reason: str, node: str,
           name_tag: str = "", key: bytes = _KEY) -> KubeObject:
    """Create this node's request of ``reason`` for ``sp`` (labelled with the node and the
    incarnation) and return it, or the request that existed under its name. A name held by
    another's Checkpoint is passed over for the tagged one (``unsquatted``). Raises the
    API's errors (KubeError), or NameTaken."""
    name = protocol.checkpoint_name(sp.sandbox, sp.incarnation, reason, name_tag)
    for attempt in (name, unsquatted(sp, reason, name_tag, key)):
        made = kube.create_checkpoint(protocol.checkpoint_object(
            sp.sandbox, attempt, reason, sp.incarnation, node=node), sp.namespace)
        if own_request(made, sp, reason, node):
            return made
    raise NameTaken(f"Checkpoint names {name} and its tagged form in {sp.namespace} are held "
                    "by Checkpoints this node did not create")
