"""Lazy restore on the cluster: a sandbox moved by a drain runs on its new node while its
memory streams in from S3 (nodeAgent.lazyRestore; docs/criu.md#lazy-restore).

The proof that it ran before its memory was in: the workload holds far more patterned
memory than it touches per tick, and its first tick on the new node reached the
external tick ledger (on the host) before the node-agent's lazy-pages daemon copied in
its last page. An eager restore (every page in before the tree runs) fails that."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest

from tests.e2e import sandboxes as sb
from tests.e2e.cluster import E2EConfig, Kube, helm_set, wait_until
from tests.support import ledger

# Much more memory than the workload touches per tick (it verifies 8 MiB a tick, a pass
# every 128 ticks), and enough that its fill from the local MinIO takes seconds: a lazy
# restore runs long before the rest comes in. Every page the restored copy touches first
# is a fault the lazy-pages daemon serves, so its first ticks are slow on a busy machine:
# in CI, with 512 MiB and 8 MiB a tick, the fill took 2.3 s and the first tick came only
# 0.11 s before its end (an idle run had 1.78 s to spare); twice the memory doubles
# the fill, not the first tick's wait.
LAZY_MEM_MB = 1024
LAZY_VERIFY_MB = 8
# How long before its last page the restored copy must have ticked: an eager restore's
# tree resumes once every page is in, so its first tick can come at most a tick period
# before the moment the restore ends (0.2 s); a lazy one runs while its memory, seconds
# of it here, streams in.
RAN_BEFORE_ALL_IN_S = 0.5

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture
def lazy_release(hermit_release: str, e2e_config: E2EConfig) -> Iterator[str]:
    """The release with lazy restore on, for this test only."""
    helm_set(e2e_config, hermit_release, "nodeAgent.lazyRestore=true")
    try:
        yield hermit_release
    finally:
        helm_set(e2e_config, hermit_release, "nodeAgent.lazyRestore=false")


def _first_tick_after_restore(name: str) -> tuple[int, float]:
    """The first tick the restored copy (restore generation 1) reported to the ledger, and
    when it arrived, in unix time."""
    collector = ledger.current()
    assert collector is not None, "no tick ledger (HERMIT_E2E_LEDGER_HOST)"
    restored = [r for r in collector.reports(name) if r.gen >= 1]
    assert restored, f"the ledger has no report of {name}'s restored copy"
    first = min(restored, key=lambda r: r.received)
    return first.tick, first.received + (time.time() - time.monotonic())


def test_a_drained_sandbox_runs_on_its_new_node_while_its_memory_streams_in(
    kube: Kube, namespace: str, lazy_release: str, e2e_config: E2EConfig,
) -> None:
    name, where = sb.start_on_spot(kube, e2e_config, lazy_release, namespace,
                                   mem_mb=LAZY_MEM_MB, verify_mb=LAZY_VERIFY_MB)
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
        filled = re.compile(
            rf"lazy restore of {re.escape(namespace)}/{re.escape(ckpt['metadata']['name'])}: "
            r"every page in after (\d+) ms \(unix time (\d+\.\d+)\)")
        line = wait_until("the new node's lazy restore to have every page in", 120,
                          lambda: filled.search(sb.node_agent_log(kube, lazy_release,
                                                                  after.node)), 0.5)
        log = sb.node_agent_log(kube, lazy_release, after.node)
        assert "cannot restore lazily" not in log, log[-3000:]
        # The workload checks its patterned memory and exits if any of it is wrong.
        sb.assert_continues(kube, namespace, after.pod, last, exact=True)
        first_tick, first_at = _first_tick_after_restore(name)
        all_in_at = float(line.group(2))
        assert first_tick == last + 1, (first_tick, last)
        assert all_in_at - first_at >= RAN_BEFORE_ALL_IN_S, (
            f"the restored copy's first tick (tick {first_tick}) reached the ledger only "
            f"{all_in_at - first_at:.3f} s before the last page was in (at least "
            f"{RAN_BEFORE_ALL_IN_S} s for a lazy restore): it did not run while its memory "
            "came in")
        print(f"drain of {where.node}: sandbox running on {after.node} {running} s after "
              f"the drain began; its first tick there {all_in_at - first_at:.3f} s before "
              f"every page of its {LAZY_MEM_MB} MiB was in ({line.group(1)} ms of fill)")
