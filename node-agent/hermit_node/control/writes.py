"""The node-agent's writes that matter (the operator waits on them): a Checkpoint's
status and a pod's restore annotations, retried while the API error is transient, and the
Warning Event of a failed checkpoint."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from hermit_common import api
from hermit_common.errors import Retryable
from hermit_common.protocol import KubeObject
from hermit_node.control.kube import Kube, KubeError
from hermit_node.control.planner import SandboxPod

log = logging.getLogger("hermit_node")

STATUS_ATTEMPTS = 5


class Writes:
    def __init__(self, kube: Kube, stopping: threading.Event) -> None:
        self._kube = kube
        self._stopping = stopping  # the agent stops: retries give up

    def write_status(self, namespace: str, name: str, status: KubeObject, *,
                     forever: bool = False) -> None:
        """Status writes matter (the operator waits on them): retry a few times, or with
        ``forever`` until it lands or the agent stops (a durable checkpoint's Completed)."""
        self.retry(f"the status of Checkpoint {namespace}/{name}", forever,
                   lambda: self._kube.patch_checkpoint_status(namespace, name, status))

    def retry(self, what: str, forever: bool, call: Callable[[], None]) -> None:
        delay = 0.2
        attempt = 0
        while True:
            attempt += 1
            try:
                call()
                return
            except KubeError as exc:
                # Only a Retryable (transient) error may pass: a deleted object or a refusal
                # will not, and this loop retries at once, so unclassified is not enough.
                if (not forever and attempt >= STATUS_ATTEMPTS) or self._stopping.is_set() \
                        or not isinstance(exc, Retryable):
                    log.error("giving up on %s: %s", what, exc)
                    return
                log.warning("%s (attempt %d)", exc, attempt)
                self._stopping.wait(delay)
                delay = min(delay * 2, 5.0)

    def event(self, ckpt: KubeObject, message: str) -> None:
        try:
            self._kube.checkpoint_event(ckpt, "Warning", api.REASON_CHECKPOINT_FAILED, message)
        except KubeError as exc:
            log.warning("%s", exc)

    def annotate(self, sp: SandboxPod, annotations: dict[str, str | None]) -> None:
        self.retry(f"annotating pod {sp.namespace}/{sp.pod}", False,
                   lambda: self._kube.annotate_pod(sp.namespace, sp.pod, annotations))
