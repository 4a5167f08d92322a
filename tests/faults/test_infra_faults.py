"""Faults of what Hermit stands on, in the middle of a migration: the operator killed
(a standby takes over), the store (MinIO) stopped during an upload and during a restore,
the API server restarted, and a sandbox pod force-deleted while its node lives.

Each scenario records its row in the ledger, then asserts nothing lost and no second
live copy at any sample (docs/faults.md).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from kubernetes import client

from tests.e2e import sandboxes as sb
from tests.e2e.cluster import S3, E2EConfig, Kube, wait_until
from tests.faults import inject, verdict
from tests.faults.ledger import Ledger

pytestmark = [pytest.mark.faults, pytest.mark.timeout(900)]

BIG = inject.BIG_MEM_MB

Obj = dict[str, Any]

NOTICE_SECONDS = 40
S3_OUTAGE_S = (12.0, 18.0)  # how long the store stays down during an upload (random)
S3_BLACK_HOLE_S = (20.0, 30.0)  # how long its packets are dropped during an upload (random)
S3_SLOW_MBIT = 64  # the node's uplink to S3 under a notice: 8 MB/s, ~50 s for BIG memory


def test_operator_killed_during_a_migration_completes_it_once(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig, ledger: Ledger,
) -> None:
    """Two operator replicas (leader election on a Lease); the active one is killed at a
    random point while a preemption checkpoint is being taken: the standby takes over
    and the sandbox moves exactly once."""
    random = inject.rng("operator killed")
    apps, coordination = client.AppsV1Api(), client.CoordinationV1Api()
    deployment = f"{hermit_release}-operator"
    apps.patch_namespaced_deployment_scale(deployment, hermit_release,
                                           {"spec": {"replicas": 2}})
    try:
        wait_until("two Ready operator replicas", 120, lambda: (
            apps.read_namespaced_deployment(deployment, hermit_release).status.ready_replicas
            or 0) >= 2)
        name, where = inject.start(kube, e2e_config, hermit_release, namespace)
        with inject.preempting(kube, e2e_config, hermit_release, namespace, name, where,
                                   NOTICE_SECONDS) as watch:
            wait_until("the Preemption checkpoint under way", NOTICE_SECONDS, lambda:
                       inject.preemption_checkpoint(namespace, name, (
                           *inject.IN_FLIGHT, "Completed")), 0.05)
            delay = random.uniform(0, 1.0)
            time.sleep(delay)  # the injection point itself
            lease = coordination.read_namespaced_lease("hermit-operator", hermit_release)
            leader = lease.spec.holder_identity
            kube.api.delete_namespaced_pod(leader, hermit_release, grace_period_seconds=0)
            # What the kill must land in: the move, before the sandbox runs again.
            moved_at_kill = int(sb.status(namespace, name).get("restores") or 0)
            _, last = inject.durable_then_last_tick(namespace, name, watch,
                                                    NOTICE_SECONDS)
            outcome = verdict.judge(kube, namespace, name, last, restores=1,
                                    avoid=where.node, timeout=180)
        new_leader = coordination.read_namespaced_lease(
            "hermit-operator", hermit_release).spec.holder_identity
        restores = int(sb.status(namespace, name).get("restores") or 0)
        row = inject.record(ledger, "operator killed (failover)", 1, outcome, watch,
                            f"leader {leader} killed +{delay:.2f}s; {new_leader} took over; "
                            f"restores {restores}")
        inject.assert_row(row)
        assert moved_at_kill == 0, "the kill came after the sandbox was restored"
        assert new_leader != leader, "the killed operator still holds the Lease"
        assert restores == 1, "moved more than once"
    finally:
        apps.patch_namespaced_deployment_scale(deployment, hermit_release,
                                               {"spec": {"replicas": 1}})


def test_s3_stopped_during_the_upload(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig, s3_for_pods: S3,
    ledger: Ledger,
) -> None:
    """MinIO stops while the stopping checkpoint uploads, for a random 12-18 s: the
    upload retries (or fails, the tree is thawed and a new request is made while the
    node is going away) and the sandbox moves with nothing lost. Long enough for four or
    five failed requests, so retention deletes the oldest Failed ones meanwhile (a CI run
    lost a sandbox to that once: the next request was named after one that existed)."""
    random = inject.rng("S3 stopped during the upload")
    name, where = inject.start(kube, e2e_config, hermit_release, namespace, mem_mb=BIG)
    stopped = False
    with inject.preempting(kube, e2e_config, hermit_release, namespace, name, where, 90) as watch:
        try:
            first = wait_until("the Preemption checkpoint uploading", 60, lambda: inject.
                               preemption_checkpoint(namespace, name, ("Uploading",)),
                               0.05)
            s3_for_pods.stop()
            stopped = True
            outage = random.uniform(*S3_OUTAGE_S)
            time.sleep(outage)  # the outage itself
            at = inject.phase_of(namespace, first["metadata"]["name"])
            s3_for_pods.start()
            stopped = False
        finally:
            if stopped:
                s3_for_pods.start()
        ckpt, last = inject.durable_then_last_tick(namespace, name, watch, 100)
        outcome = verdict.judge(kube, namespace, name, last, restores=1,
                                avoid=where.node, timeout=240)
    row = inject.record(ledger, "S3 stopped during upload", 1, outcome, watch,
                        f"down {outage:.1f}s from {first['metadata']['name']} Uploading "
                        f"(then {at}); moved by {ckpt['metadata']['name']}")
    inject.assert_row(row)


def test_s3_black_holed_during_the_upload(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig, s3_for_pods: S3,
    ledger: Ledger,
) -> None:
    """Every packet from the nodes to S3 is dropped while the stopping checkpoint
    uploads, for a random 20-30 s: the connections under way hang and new ones get no
    answer, nothing is refused. The requests time out or resume once packets flow again;
    the checkpoint is durable within the 90 s notice and the sandbox moves with nothing
    lost. The outage must overlap the upload: it is still Uploading when the outage ends."""
    random = inject.rng("S3 black-holed during the upload")
    name, where = inject.start(kube, e2e_config, hermit_release, namespace, mem_mb=BIG)
    with inject.preempting(kube, e2e_config, hermit_release, namespace, name, where, 90) as watch:
        first = wait_until("the Preemption checkpoint uploading", 60, lambda: inject.
                           preemption_checkpoint(namespace, name, ("Uploading",)), 0.05)
        outage = random.uniform(*S3_BLACK_HOLE_S)
        with s3_for_pods.black_holed():
            time.sleep(outage)  # the outage itself
            at = inject.phase_of(namespace, first["metadata"]["name"])
        ckpt, last = inject.durable_then_last_tick(namespace, name, watch, 100)
        outcome = verdict.judge(kube, namespace, name, last, restores=1,
                                avoid=where.node, timeout=240)
    row = inject.record(ledger, "S3 black-holed during upload", 1, outcome, watch,
                        f"packets dropped {outage:.1f}s from {first['metadata']['name']} "
                        f"Uploading (then {at}); moved by {ckpt['metadata']['name']}")
    assert at == "Uploading", f"the outage missed the upload: {at} when it ended"
    inject.assert_row(row)


def test_s3_slow_for_the_whole_notice(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig, s3_for_pods: S3,
    ledger: Ledger,
) -> None:
    """The preempted node's uploads to S3 go at 64 Mbit/s from before the notice until
    the node is gone: the stopping checkpoint of 384 MiB of memory takes most of a 90 s
    notice (the tree stays frozen meanwhile), no request gives up on a slow but moving
    connection, and the sandbox moves with nothing lost."""
    name, where = inject.start(kube, e2e_config, hermit_release, namespace, mem_mb=BIG)
    with s3_for_pods.slowed_from(where.node, S3_SLOW_MBIT), inject.preempting(
            kube, e2e_config, hermit_release, namespace, name, where, 90) as watch:
        started = time.monotonic()
        ckpt, last = inject.durable_then_last_tick(namespace, name, watch, 100)
        durable = sb.since(started)
        outcome = verdict.judge(kube, namespace, name, last, restores=1,
                                avoid=where.node, timeout=240)
    stats = ckpt["status"]
    uploaded = int(stats.get("uploadedBytes") or 0)
    upload_s = int(stats.get("uploadMs") or 0) / 1000
    # The fault must have landed: at that rate, its bytes take this long at least.
    floor_s = uploaded * 8 / (S3_SLOW_MBIT * 1e6)
    row = inject.record(ledger, "S3 slow for the whole notice", 1, outcome, watch,
                        f"{S3_SLOW_MBIT} Mbit/s from {where.node}: {uploaded / 2**20:.0f} MiB "
                        f"uploaded in {upload_s:.1f}s (>= {floor_s:.1f}s at that rate), "
                        f"durable {durable}s into the notice, moved by "
                        f"{ckpt['metadata']['name']}")
    inject.assert_row(row)
    assert floor_s >= 10 and upload_s >= 0.8 * floor_s, f"the upload was not slowed: {row.note}"


def test_s3_stopped_during_the_restore(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig, s3_for_pods: S3,
    ledger: Ledger,
) -> None:
    """MinIO stops once the stopping checkpoint is durable: restores fail while it is
    down (retried with backoff, the sandbox is not Failed) and succeed once it is back."""
    name, where = inject.start(kube, e2e_config, hermit_release, namespace)
    stopped = False
    with inject.preempting(kube, e2e_config, hermit_release, namespace, name, where,
                               NOTICE_SECONDS) as watch:
        try:
            _, last = inject.durable_then_last_tick(namespace, name, watch,
                                                    NOTICE_SECONDS)
            s3_for_pods.stop()
            stopped = True
            attempts = wait_until("a failed restore attempt while S3 is down", 180,
                                  lambda: _failed_attempts(namespace, name))
            phase = sb.status(namespace, name).get("phase")
            s3_for_pods.start()
            stopped = False
        finally:
            if stopped:
                s3_for_pods.start()
        outcome = verdict.judge(kube, namespace, name, last, restores=1,
                                avoid=where.node, timeout=420)
    row = inject.record(ledger, "S3 stopped during restore", 1, outcome, watch,
                        f"{attempts} failed restore attempt(s) while down (phase {phase})")
    inject.assert_row(row)
    assert phase != "Failed", "a transient failure is not the end"


def _failed_attempts(ns: str, name: str) -> int | None:
    attempts = int(sb.status(ns, name).get("restoreAttempts") or 0)
    return attempts if attempts >= 1 else None


def test_api_server_restarted_during_a_migration(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig, ledger: Ledger,
) -> None:
    """kube-apiserver is stopped and started again (hack/cluster restart-apiserver) at a
    random point after the Preemption checkpoint starts: every watch breaks and every
    write is refused for a while; the checkpoint's status write is retried until it lands
    and the sandbox moves once, with nothing lost."""
    random = inject.rng("API server restarted")
    name, where = inject.start(kube, e2e_config, hermit_release, namespace, mem_mb=BIG)
    with inject.preempting(kube, e2e_config, hermit_release, namespace, name, where, 60) as watch:
        wait_until("the Preemption checkpoint under way", 45, lambda: inject.
                   preemption_checkpoint(namespace, name, (*inject.IN_FLIGHT,
                                                           "Completed")), 0.05)
        delay = random.uniform(0, 2.0)
        time.sleep(delay)  # the injection point itself
        # What the restart must land in: the move, before the sandbox runs again.
        moved_at_restart = int(sb.status(namespace, name).get("restores") or 0)
        started = time.monotonic()
        sb.restart_apiserver(e2e_config)
        down = sb.since(started)
        ckpt, last = inject.durable_then_last_tick(namespace, name, watch, 60)
        outcome = verdict.judge(kube, namespace, name, last, restores=1,
                                avoid=where.node, timeout=240)
    restores = int(sb.status(namespace, name).get("restores") or 0)
    row = inject.record(ledger, "API server restarted", 1, outcome, watch,
                        f"restarted +{delay:.2f}s into the checkpoint, ready again after "
                        f"{down}s; moved by {ckpt['metadata']['name']}, restores {restores}")
    inject.assert_row(row)
    assert moved_at_restart == 0, "the restart came after the sandbox was restored"
    assert restores == 1, "moved more than once"


def test_sandbox_pod_force_deleted_while_its_node_lives(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig, ledger: Ledger,
) -> None:
    """The sandbox's pod is deleted with grace period 0: the pod object is gone at once
    while its processes may still run on the node until its kubelet ends them. The
    operator replaces the pod from the last Interval checkpoint; at no sample may the
    old tree and the restored one both be alive."""
    interval = 30  # the CRD minimum
    name, where = inject.start(kube, e2e_config, hermit_release, namespace,
                         checkpoint={"intervalSeconds": interval})
    ckpt = wait_until("a Completed Interval checkpoint", interval + 60,
                      sb.completed_checkpoint(namespace, "Interval", sandbox_name=name), 1)
    with inject.watching(name) as watch:
        last = sb.ticks(kube, namespace, where.pod)[-1]
        old = inject.tree_roots(name)
        assert len(old) == 1, f"expected one live tree before the delete, found {old}"
        kube.api.delete_namespaced_pod(where.pod, namespace, grace_period_seconds=0)
        deleted = time.monotonic()
        old_gone = wait_until("the old tree ended on the node", 120, lambda: (not (
            old & inject.tree_roots(name)) and sb.since(deleted)) or None, 0.1)
        outcome = verdict.judge(kube, namespace, name, last, restores=1, allow_replay=True,
                                timeout=240)
    restored = sb.status(namespace, name).get("restoredFrom") or {}
    row = inject.record(ledger, "sandbox pod force-deleted", 1, outcome, watch,
                        f"old tree gone {old_gone}s after the delete; restored from "
                        f"{restored.get('name')} (Interval {ckpt['metadata']['name']} or "
                        f"newer)")
    inject.assert_row(row)
    assert restored.get("name"), "status.restoredFrom missing"
