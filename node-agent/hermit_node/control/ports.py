"""What the node-agent's loop drives, as narrow protocols: the checkpoint and restore
engines, the stores, its watched copy of the node, and its optional collaborators (tree
control, health, collector, fence, upload limiter, capture watch), each with a null object
as the default (``NO_TREES``, ``NO_HEALTH``, ``NO_COLLECTOR``, ``NO_FENCE``, ``NO_LIMITER``,
``NO_CAPTURE_WATCH``), never ``None``."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Protocol

from hermit_common.health import Heartbeats, Verdict
from hermit_common.protocol import KubeObject
from hermit_node.control.planner import SandboxPod
from hermit_node.control.storage import Location
from hermit_node.engine.checkpoint import (
    NO_PROGRESS,
    CheckpointProgress,
    CheckpointResult,
    CheckpointTarget,
)
from hermit_node.engine.restore import RestoreResult, RestoreTarget
from hermit_node.host import freezer

if TYPE_CHECKING:
    from hermit_common.store import CheckpointStore


class Checkpointer(Protocol):
    def checkpoint(self, target: CheckpointTarget, *, stop: bool = False,
                   keep_local: bool = False, deadline: float | None = None,
                   progress: CheckpointProgress = NO_PROGRESS,
                   store: CheckpointStore | None = None,
                   urgent: bool = False) -> CheckpointResult: ...


class Restorer(Protocol):
    lazy: bool  # restores leave the tree's pages to a lazy-pages daemon of this process

    def restore(self, target: RestoreTarget, *, timeout: float = 120.0,
                store: CheckpointStore | None = None) -> RestoreResult: ...


class StoreResolver(Protocol):
    """Which store a sandbox's next checkpoint goes to, and which one an existing
    checkpoint is read from (``storage.Stores``)."""

    def for_sandbox(self, sandbox: KubeObject) -> tuple[CheckpointStore, Location]: ...

    def for_checkpoint(self, ckpt: KubeObject,
                       owner: KubeObject | None) -> CheckpointStore: ...


class NodeView(Protocol):
    """This node's pods, the Checkpoints labelled with it and its Node object, as last
    seen (``informer.WatchedNode``); KubeError while they are not known yet."""

    def pods_now(self) -> list[KubeObject]: ...

    def checkpoints_now(self) -> list[KubeObject]: ...

    def node_now(self) -> KubeObject | None: ...

    def healthy(self) -> bool: ...


class TreeControl(Protocol):
    """Thaws or ends a container's frozen tree (the cgroup freezer)."""

    def settle(self, init_pid: int, *, kill: bool) -> bool: ...

    def restore_left(self, init_pid: int) -> str: ...

    def end(self, init_pid: int) -> int: ...


class NoTrees:
    """A ``TreeControl`` that finds nothing frozen and nothing restored (tests)."""

    def settle(self, init_pid: int, *, kill: bool) -> bool:
        return False

    def restore_left(self, init_pid: int) -> str:
        return freezer.NOTHING_RESTORED

    def end(self, init_pid: int) -> int:
        return 0


NO_TREES: TreeControl = NoTrees()


class Health(Protocol):
    """This agent's health (``health.AgentHealth``): the loop beats when the API answers,
    and the node is labelled once the agent is ready."""

    @property
    def beats(self) -> Heartbeats: ...

    def readiness(self) -> Verdict: ...


class NoHealth:
    """A ``Health`` that is never ready (no probes: the node is never labelled)."""

    def __init__(self) -> None:
        self.beats = Heartbeats()  # beaten, never read

    def readiness(self) -> Verdict:
        return Verdict(False, "the node-agent reports no health")


NO_HEALTH: Health = NoHealth()


class AfterCheckpoint(Protocol):
    """What runs after a routine checkpoint (``collect.Collector``: old ones deleted)."""

    def after_checkpoint(self, name: str, sp: SandboxPod, store: CheckpointStore,
                         halted: Callable[[], bool]) -> object: ...


class NoCollector:
    """An ``AfterCheckpoint`` that deletes nothing from the store."""

    def after_checkpoint(self, name: str, sp: SandboxPod, store: CheckpointStore,
                         halted: Callable[[], bool]) -> None:
        return None


NO_COLLECTOR: AfterCheckpoint = NoCollector()


class RestoreFence(Protocol):
    """Whether an older incarnation of a sandbox may still run (``fence.Fence``)."""

    def holds(self, sp: SandboxPod) -> bool: ...


class NoFence:
    """A ``RestoreFence`` that never holds a restore back (tests)."""

    def holds(self, sp: SandboxPod) -> bool:
        return False


NO_FENCE: RestoreFence = NoFence()


class UploadPromoter(Protocol):
    """The node's upload bandwidth (``bandwidth.UploadLimiter``), shared with the engine."""

    def promote(self, key: object) -> int: ...


class NoLimiter:
    """An ``UploadPromoter`` without a limiter: no upload waits, so none is promoted."""

    def promote(self, key: object) -> int:
        return 0


NO_LIMITER: UploadPromoter = NoLimiter()


class CaptureWatch(Protocol):
    """Told, on the checkpoint's thread, that checkpoint ``name`` (of ``reason``) of pod
    ``sp`` has captured its tree, which is still frozen (``TurnService.captured`` reads its
    processes' counters then). Quick, as the sandbox waits; must not raise."""

    def captured(self, sp: SandboxPod, name: str, reason: str) -> None: ...


class NoCaptureWatch:
    """A ``CaptureWatch`` that reads nothing (no turn endpoint)."""

    def captured(self, sp: SandboxPod, name: str, reason: str) -> None:
        return None


NO_CAPTURE_WATCH: CaptureWatch = NoCaptureWatch()


def utc_now() -> datetime:
    return datetime.now(UTC)
