"""An AWS rebalance recommendation: an early checkpoint while the sandbox runs on.

The recommendation is advisory (no deadline, nothing is terminated): the node-agent
takes one routine ``Rebalance`` checkpoint of each sandbox on the node and leaves the
sandboxes running. When the interruption notice follows, the stopping checkpoint finds
most of the sandbox's chunks in the store already and uploads only what changed, and the
new node, given the replacement pod while that checkpoint is taken (the overlap),
prefetches the early checkpoint's chunks into its chunk cache: the restore takes most of
them from there (docs/storage.md, "Prefetch and the chunk cache").
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from hermit_common import protocol
from tests.e2e import sandboxes as sb
from tests.e2e.cluster import E2EConfig, Kube, helm_set, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NOTICE_SECONDS = 30
CACHE_BYTES = 2 * 1024 ** 3


def _rebalance_checkpoints(ns: str, name: str) -> list[sb.Obj]:
    return [c for c in sb.checkpoints(ns) if c["spec"]["reason"] == protocol.REBALANCE
            and c["spec"]["sandboxRef"]["name"] == name]


@pytest.fixture
def prefetch_release(hermit_release: str, e2e_config: E2EConfig) -> Iterator[str]:
    """The release with the chunk cache and the prefetch on (off by default), for this
    test only."""
    helm_set(e2e_config, hermit_release, f"nodeAgent.chunkCacheBytes={CACHE_BYTES}")
    try:
        yield hermit_release
    finally:
        helm_set(e2e_config, hermit_release, "nodeAgent.chunkCacheBytes=0")


def test_rebalance_recommendation_checkpoints_early_and_the_notice_uploads_little(
    kube: Kube, namespace: str, prefetch_release: str, e2e_config: E2EConfig,
) -> None:
    hermit_release = prefetch_release
    name, where = sb.start_on_spot(kube, e2e_config, hermit_release, namespace)
    sb.rebalance(e2e_config, where.node, timeout=60)
    preempted = False
    try:
        early = _early_checkpoint(kube, namespace, name, where)
        sb.wait_agent_ready(kube, hermit_release, where.node)
        preempted = True
        ckpt = _preempt(kube, e2e_config, namespace, name, where)
    finally:
        if not preempted:  # the node keeps advising: no other test may use it
            sb.preempt_now(e2e_config, where.node)
    st, pst = early["status"], ckpt["status"]
    cached, chunks, message = _restored_from_cache(kube, namespace, name)
    print(f"Rebalance checkpoint: {st['uploadedBytes']} bytes uploaded of "
          f"{st['storedBytes']} stored, frozen {st['frozenMs']} ms; Preemption checkpoint: "
          f"{pst['uploadedBytes']} bytes uploaded of {pst['storedBytes']} stored, frozen "
          f"{pst['frozenMs']} ms; restore: {cached} of {chunks} chunks from the new node's "
          f"cache ({message})")
    # The new node prefetched the early checkpoint while the stopping one was taken.
    assert cached > 0, message
    # The stopping checkpoint reused most of the early one's chunks.
    assert pst["uploadedBytes"] < pst["storedBytes"] / 2, pst
    # One early checkpoint per recommendation, however many times it was polled.
    assert [c["metadata"]["name"] for c in _rebalance_checkpoints(namespace, name)] == [
        early["metadata"]["name"]]


def _restored_from_cache(kube: Kube, ns: str, name: str) -> tuple[int, int, str]:
    """(chunks from the local cache, chunks, the message) of the sandbox's restored pod."""
    pod = kube.pod(ns, sb.status(ns, name)["podName"])
    assert pod is not None
    annotations = pod["metadata"].get("annotations") or {}
    message = str(annotations.get(protocol.ANNOTATION_RESTORE_MESSAGE) or "")
    found = re.search(r"(\d+) of (\d+) chunks from the local cache", message)
    assert found, f"the restore message does not count cached chunks: {message!r}"
    return int(found.group(1)), int(found.group(2)), message


def _early_checkpoint(kube: Kube, ns: str, name: str, where: sb.Running) -> sb.Obj:
    """The Completed Rebalance checkpoint, the sandbox still running in the same pod."""
    early = wait_until("a Completed Rebalance checkpoint", 120, sb.completed_checkpoint(
        ns, protocol.REBALANCE, sandbox_name=name), 0.5)
    st = early["status"]
    assert "kept running" in st["message"], st
    at = sb.ticks(kube, ns, where.pod)
    wait_until("the sandbox ticking after its Rebalance checkpoint", 30,
               lambda: len(sb.ticks(kube, ns, where.pod)) > len(at))
    status = sb.status(ns, name)
    assert (status.get("phase"), status.get("podName")) == ("Running", where.pod), status
    # Its first checkpoint: every chunk was new.
    assert st["uploadedBytes"] >= st["storedBytes"] > 0, st
    return early


def _preempt(kube: Kube, cfg: E2EConfig, ns: str, name: str, where: sb.Running) -> sb.Obj:
    """A spot notice: the Completed Preemption checkpoint, the sandbox continued elsewhere."""
    with sb.preempting(cfg, where.node, NOTICE_SECONDS):
        old = sb.LastTick(kube, ns, where.pod)
        ckpt = sb.durable_reading("a Completed Preemption checkpoint", NOTICE_SECONDS,
                                  sb.completed_checkpoint(ns, protocol.PREEMPTION,
                                                          sandbox_name=name), [old])
        last = old.final()
        after = sb.wait_running(kube, ns, name, restores=1, avoid=where.node,
                                timeout=180, min_ticks=1)
        sb.assert_continues(kube, ns, after.pod, last, exact=True)
    return ckpt
