"""One notice, many sandboxes: a spot node running several sandboxes gets its notice
(docs/faults.md). The node-agent checkpoints all of them within the notice, sharing its
upload bandwidth, and each moves once, judged by the external tick ledger."""

from __future__ import annotations

import time
import uuid
from contextlib import ExitStack

import pytest

from tests.e2e import sandboxes as sb
from tests.e2e.cluster import E2EConfig, Kube, wait_until
from tests.faults import inject, verdict
from tests.faults.ledger import Ledger, Row

pytestmark = [pytest.mark.faults, pytest.mark.timeout(900)]

SANDBOXES = 4
NOTICE_SECONDS = 90


def test_a_notice_on_a_node_with_many_sandboxes_moves_each_once(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig, ledger: Ledger,
) -> None:
    """Four self-checking sandboxes land on one spot node (the other spot nodes cordoned
    while they start), then a 90 s notice: every one has a Completed Preemption
    checkpoint within the notice and runs again on another node once, with no tick lost
    or duplicated and never two live copies of one."""
    sb.ensure_spot_nodes(kube, e2e_config, 2)
    node = sb.ready_spot_nodes(kube)[0]
    sb.wait_agent_ready(kube, hermit_release, node)
    tag = uuid.uuid4().hex[:4]
    names = [f"crowd-{tag}-{i}" for i in range(SANDBOXES)]
    with sb.only_schedulable_spot(kube, node):
        for name in names:
            sb.create_sandbox(namespace, name, verdict.spec(e2e_config.sandbox_image, name))
        where = {name: sb.wait_running(kube, namespace, name, min_ticks=5) for name in names}
    assert {w.node for w in where.values()} == {node}, where
    started = time.monotonic()
    outcomes: dict[str, verdict.Outcome] = {}
    with sb.preempting(e2e_config, node, NOTICE_SECONDS), ExitStack() as stack:
        watches = {name: stack.enter_context(inject.watching(name)) for name in names}
        durable = {name: wait_until(f"{name}: a Completed Preemption checkpoint",
                                    NOTICE_SECONDS, lambda n=name: inject.
                                    preemption_checkpoint(namespace, n, ("Completed",)), 0.2)
                   for name in names}
        all_durable = sb.since(started)
        for name in names:
            outcomes[name] = verdict.judge(kube, namespace, name, restores=1, avoid=node,
                                           timeout=240)
    most = max(w.most for w in watches.values())
    made = ", ".join(c["metadata"]["name"] for c in durable.values())
    row = Row("many sandboxes on one node", 1, SANDBOXES,
              sum(o.lost for o in outcomes.values()),
              sum(max(o.duplicated, watches[n].duplicated) for n, o in outcomes.items()),
              f"{SANDBOXES} sandboxes on {node}, all durable {all_durable}s into a "
              f"{NOTICE_SECONDS} s notice ({made}); "
              f"at most {most} live copies of one; "
              + "; ".join(f"{n}: {o.detail}" for n, o in outcomes.items()),
              sum(o.ledger_lost or 0 for o in outcomes.values()),
              sum(o.ledger_duplicated or 0 for o in outcomes.values()))
    ledger.record(row)
    print(f"row: {row}")
    inject.assert_row(row)
    assert all(o.ledger_lost is not None for o in outcomes.values()), row.note
    assert all_durable <= NOTICE_SECONDS, f"not all durable within the notice: {row.note}"
