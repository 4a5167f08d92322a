"""Lazy restore on the cluster: a sandbox moved by a drain runs on its new node while its
memory streams in from S3 (nodeAgent.lazyRestore; docs/criu.md#lazy-restore)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.e2e import sandboxes as sb
from tests.e2e.cluster import E2EConfig, Kube, helm_set, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture
def lazy_release(hermit_release: str, e2e_config: E2EConfig) -> Iterator[str]:
    """The release with lazy restore on, for this test only."""
    helm_set(e2e_config, hermit_release, "nodeAgent.lazyRestore=true")
    try:
        yield hermit_release
    finally:
        helm_set(e2e_config, hermit_release, "nodeAgent.lazyRestore=false")


def test_a_drained_sandbox_runs_on_its_new_node_while_its_memory_streams_in(
    kube: Kube, namespace: str, lazy_release: str, e2e_config: E2EConfig,
) -> None:
    name, where = sb.start_on_spot(kube, e2e_config, lazy_release, namespace)
    started = time.monotonic()
    with sb.draining(e2e_config, where.node) as drain:
        old = sb.LastTick(kube, namespace, where.pod)
        ckpt = sb.durable_reading("a Completed Eviction checkpoint", 120, sb.completed_checkpoint(
            namespace, "Eviction", sandbox_name=name), [old])
        last = old.final()
        out, _ = drain.communicate(timeout=240)
        assert drain.returncode == 0, f"drain failed: {out}"
        after = sb.wait_running(kube, namespace, name, restores=1, avoid=where.node,
                                min_ticks=1)
        running = sb.since(started)
        filled = f"lazy restore of {namespace}/{ckpt['metadata']['name']}: every page in"
        wait_until("the new node's lazy restore to have every page in", 120,
                   lambda: filled in sb.node_agent_log(kube, lazy_release, after.node), 0.5)
        log = sb.node_agent_log(kube, lazy_release, after.node)
        assert "cannot restore lazily" not in log, log[-3000:]
        # The workload checks its patterned memory every tick and exits if it is wrong.
        sb.assert_continues(kube, namespace, after.pod, last, exact=True)
        line = next(ln for ln in log.splitlines() if filled in ln)
        print(f"drain of {where.node}: sandbox running on {after.node} {running} s after "
              f"the drain began; {line.split('every page in', 1)[1].strip()}")
