"""The node-agent's decisions (hermit_node.control.planner): pure functions over API dicts."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from hermit_common import protocol
from hermit_common.errors import CheckpointFailed, CheckpointRefused, RestoreFailed
from hermit_common.pin import Pin
from hermit_common.store import UploadProgress
from hermit_node import main as node_main
from hermit_node.control import jobs as jobs_module
from hermit_node.control import planner
from hermit_node.control.agent import NodeAgent
from hermit_node.control.kube import KubeTransient
from hermit_node.control.watchers import Notice
from hermit_node.engine.checkpoint import CheckpointResult
from hermit_node.host import freezer
from tests.support.crds import schema_errors
from tests.support.node_agent import (
    DIGEST,
    IMAGE_DIGEST,
    NODE,
    NOW,
    RESULT,
    FakeEngine,
    FakeKube,
    FakeManifests,
    FakeStores,
    FakeTrees,
    ckpt,
    fake_proc,
    make_agent,
    notice,
    pod,
    sps,
    with_status,
)
from tests.support.wait import wait_until


def named(sp: planner.SandboxPod, reason: str, tag: str) -> str:
    """The name of the request a planner asks for with ``tag`` (requests.create makes it)."""
    return protocol.checkpoint_name(sp.sandbox, sp.incarnation, reason, tag)


# -- binding identity --------------------------------------------------------------------

def test_sandbox_pod_binding_identity() -> None:
    sp = planner.sandbox_pod(pod(annotations={protocol.ANNOTATION_WORKSPACE_PATH: "/work"}))
    assert sp is not None
    assert (sp.namespace, sp.pod, sp.sandbox, sp.sandbox_uid, sp.incarnation) == (
        "agents", "box-1", "box", "sbx-uid", 1)
    assert sp.container_id == "containerd://" + "12" * 32  # the first spec container's
    assert sp.image_digest == IMAGE_DIGEST
    assert sp.workspace_path == "/work"
    assert sp.running and sp.has_live_tree
    assert sp.key == ("agents", "box")


def test_checkpoint_view_reads_what_the_agent_reads() -> None:
    view = planner.CheckpointView.from_object(ckpt("c1", reason=protocol.PREEMPTION,
                                                   status={"phase": protocol.DUMPING}))
    assert (view.namespace, view.name, view.uid, view.reason, view.sandbox, view.phase) == (
        "agents", "c1", "uid-c1", protocol.PREEMPTION, "box", protocol.DUMPING)
    assert view.stopping
    bare = planner.CheckpointView.from_object({"metadata": {"namespace": "agents"}})
    assert (bare.name, bare.uid, bare.reason, bare.sandbox, bare.phase, bare.stopping) == (
        "", "", "", "", protocol.PENDING, False)


def test_workspace_path_defaults() -> None:
    sp = planner.sandbox_pod(pod())
    assert sp is not None and sp.workspace_path == "/workspace"


@pytest.mark.parametrize("kwargs", [{"sandbox": None}, {"owner": False}])
def test_non_sandbox_pods_are_ignored(kwargs: dict[str, Any]) -> None:
    assert planner.sandbox_pod(pod(**kwargs)) is None


def test_only_pods_on_this_node() -> None:
    assert [sp.pod for sp in sps(pod("a-1", sandbox="a"), pod("b-1", sandbox="b", node="x"))] \
        == ["a-1"]


# -- notices ---------------------------------------------------------------------------

def test_preempt_checkpoint_name() -> None:
    assert protocol.checkpoint_name("box", 3, protocol.PREEMPTION) == "box-3-preempt"


def test_notice_checkpoints_every_live_sandbox_once() -> None:
    pods = sps(
        pod("a-1", sandbox="a"),
        pod("b-1", sandbox="b", incarnation=1, terminating=True),  # old, going away
        pod("b-2", sandbox="b", incarnation=2),
        pod("c-1", sandbox="c", running=False, phase="Pending"),
        pod("d-2", sandbox="d", incarnation=2,
            annotations={protocol.ANNOTATION_RESTORE_FROM: "d-1-preempt"}),  # init still waiting
        pod("e-2", sandbox="e", incarnation=2,
            annotations={protocol.ANNOTATION_RESTORE_FROM: "e-1-preempt",
                         protocol.ANNOTATION_RESTORE_PHASE: "Restored"}),
        pod("f-1", sandbox="f", phase="Succeeded", running=False),
    )
    assert [sp.pod for sp in planner.pods_to_checkpoint_on_notice(pods)] == ["a-1", "b-2", "e-2"]


def test_checkpoint_object_for_a_notice() -> None:
    body = protocol.checkpoint_object("box", "box-1-preempt", "Preemption", 1)
    assert body == {
        "apiVersion": "hermit.dev/v1alpha1", "kind": "Checkpoint",
        "metadata": {"name": "box-1-preempt",
                     "labels": {protocol.LABEL_SANDBOX: "box", protocol.LABEL_INCARNATION: "1"}},
        "spec": {"sandboxRef": {"name": "box"}, "reason": "Preemption"},
    }
    assert schema_errors({**body, "metadata": {**body["metadata"], "namespace": "agents"}}) == []
    with pytest.raises(ValueError):
        protocol.checkpoint_object("box", "x", "Whim")


def test_taint_and_cordon_patch_keeps_other_taints() -> None:
    node = {"metadata": {"name": NODE, "resourceVersion": "42"},
            "spec": {"taints": [{"key": "gpu", "value": "yes", "effect": "NoSchedule"}]}}
    patch = planner.node_taint_patch(node, "spot-interruption")
    assert patch == {
        "metadata": {"resourceVersion": "42"},
        "spec": {"unschedulable": True, "taints": [
            {"key": "gpu", "value": "yes", "effect": "NoSchedule"},
            {"key": "hermit.dev/interruption", "value": "spot-interruption",
             "effect": "NoSchedule"}]},
    }


def test_taint_patch_is_none_when_done_and_cordons_when_only_tainted() -> None:
    taint = planner.interruption_taint("preemption")
    assert planner.node_taint_patch(
        {"spec": {"unschedulable": True, "taints": [taint]}}, "preemption") is None
    patch = planner.node_taint_patch({"spec": {"taints": [taint]}}, "termination")
    assert patch is not None
    assert patch["spec"] == {"unschedulable": True, "taints": [taint]}  # not duplicated


# -- checkpoint requests ---------------------------------------------------------------

def test_serves_pending_requests_for_sandboxes_here() -> None:
    pods = sps(pod("box-1"), pod("other-1", sandbox="other"))
    requests = [
        ckpt("done", status={"phase": "Completed"}),
        ckpt("elsewhere", sandbox="remote"),  # its pod is on another node
        ckpt("wrong-ns", namespace="team-b"),
        ckpt("manual"),
        ckpt("other-turn", sandbox="other", reason="Turn"),
    ]
    served = planner.checkpoints_to_serve(requests, pods)
    assert [(c["metadata"]["name"], sp.pod) for c, sp in served] == [
        ("manual", "box-1"), ("other-turn", "other-1")]


def test_serves_only_requests_labelled_with_this_node() -> None:
    """The operator labels a request with the pod's node; unlabelled (not yet adopted) or
    another node's requests wait: the API server would refuse this node's status write."""
    pods = sps(pod("box-1"))
    assert planner.checkpoints_to_serve([ckpt("unlabelled", node=None)], pods) == []
    assert planner.checkpoints_to_serve([ckpt("theirs", node="node-b")], pods) == []
    assert [c["metadata"]["name"] for c, _ in planner.checkpoints_to_serve(
        [ckpt("mine")], pods)] == ["mine"]


def test_one_request_per_sandbox_stopping_first_then_oldest() -> None:
    pods = sps(pod("box-1"))
    requests = [
        ckpt("newer", created="2026-01-02T03:00:09Z"),
        ckpt("older", created="2026-01-02T03:00:01Z"),
        ckpt("box-1-preempt", reason="Preemption", created="2026-01-02T03:00:05Z"),
    ]
    served = planner.checkpoints_to_serve(requests, pods)
    assert [c["metadata"]["name"] for c, _ in served] == ["box-1-preempt"]
    served = planner.checkpoints_to_serve(requests[:2], pods)
    assert [c["metadata"]["name"] for c, _ in served] == ["older"]


def test_requests_wait_while_the_pod_is_not_live() -> None:
    waiting = pod("box-2", incarnation=2, annotations={protocol.ANNOTATION_RESTORE_FROM: "c1"})
    assert planner.checkpoints_to_serve([ckpt("m")], sps(waiting)) == []
    assert planner.checkpoints_to_serve([ckpt("m")], sps(pod(running=False))) == []


def test_stopping_reasons() -> None:
    assert [r for r in protocol.REASONS if protocol.is_stopping(r)] == [
        "Preemption", "Eviction", "Suspend"]


def test_only_a_notice_or_a_drain_uploads_urgently() -> None:
    assert [r for r in protocol.REASONS if planner.upload_is_urgent(r)] == [
        "Preemption", "Eviction"]


def test_stale_checkpoints_are_this_nodes_unfinished_ones() -> None:
    items = [
        ckpt("mine", status={"phase": "Dumping", "nodeName": NODE}),
        ckpt("theirs", status={"phase": "Uploading", "nodeName": "node-b"}),
        ckpt("running-now", status={"phase": "Dumping", "nodeName": NODE}),
        ckpt("done", status={"phase": "Completed", "nodeName": NODE}),
    ]
    stale = planner.stale_checkpoints(items, NODE, {("agents", "running-now")})
    assert [c["metadata"]["name"] for c in stale] == ["mine"]


# -- restores --------------------------------------------------------------------------

def test_pods_to_restore() -> None:
    want = {protocol.ANNOTATION_RESTORE_FROM: "box-1-preempt"}
    pods = sps(
        pod("a-2", sandbox="a", annotations=want),
        pod("b-2", sandbox="b",
            annotations={**want, protocol.ANNOTATION_RESTORE_PHASE: "Restoring"}),
        pod("c-2", sandbox="c", annotations={**want, protocol.ANNOTATION_RESTORE_PHASE: "Failed"}),
        pod("d-2", sandbox="d", annotations=want, running=False, phase="Pending"),
        pod("e-1", sandbox="e"),
    )
    done = [ckpt("box-1-preempt", sandbox=sb, reason="Preemption",
                 status={"phase": "Completed"}) for sb in "abcde"]
    assert [sp.pod for sp in planner.pods_to_restore(pods, done)] == ["a-2"]
    assert [sp.pod for sp in planner.stale_restores(pods, set())] == ["b-2"]
    assert planner.stale_restores(pods, {("agents", "b")}) == []


@pytest.mark.parametrize(("phase", "starts"), [
    (None, False), ("Dumping", False), ("Uploading", False),  # still taken: the init waits
    ("Completed", True),
    ("Failed", True),  # started, it fails and says why; the operator deletes the pod
])
def test_a_replacement_waits_until_its_checkpoint_is_no_longer_in_flight(
        phase: str | None, starts: bool) -> None:
    """A move's replacement is created while its checkpoint is taken (the operator's
    overlap): its restore starts only once that checkpoint is Completed."""
    pods = sps(pod("a-2", sandbox="a",
                   annotations={protocol.ANNOTATION_RESTORE_FROM: "a-1-preempt"}))
    c = ckpt("a-1-preempt", sandbox="a", reason="Preemption",
             status=None if phase is None else {"phase": phase})
    assert bool(planner.pods_to_restore(pods, [c])) is starts
    other_namespace = ckpt("a-1-preempt", sandbox="a", namespace="elsewhere",
                           status={"phase": "Dumping"})
    assert planner.pods_to_restore(pods, [other_namespace]) == pods
    assert planner.pods_to_restore(pods, None) == []  # not listed: the next loop decides


def test_restore_origin() -> None:
    done = ckpt("box-1-preempt", status={"phase": "Completed", "manifestDigest": DIGEST})
    assert planner.restore_origin(done, "box-1-preempt") == Pin(
        "agents", "box", "box-1-preempt", parent="", digest=DIGEST)
    assert planner.restore_origin(None, "x") == "Checkpoint x does not exist"
    assert planner.restore_origin(ckpt("p", status={"phase": "Failed"}), "p") == \
        "Checkpoint p is Failed, not Completed"
    assert planner.restore_origin(ckpt("p"), "p") == "Checkpoint p is Pending, not Completed"
    fork = ckpt("f", sandbox="parent", status={"phase": "Completed", "manifestDigest": DIGEST})
    assert planner.restore_origin(fork, "f") == Pin("agents", "parent", "f", parent="",
                                                    digest=DIGEST)
    moved = ckpt("m", status={"phase": "Completed", "manifestDigest": DIGEST,
                              "parent": "box-0-x", "lineage": ["u0", "u1"]})
    assert planner.restore_origin(moved, "m") == Pin(
        "agents", "box", "m", parent="box-0-x", lineage=("u0", "u1"), digest=DIGEST)


def test_completed_status_records_the_signed_lineage() -> None:
    import dataclasses

    status = planner.status_completed(dataclasses.replace(RESULT, lineage=("u0", "u1")),
                                      NOW, stopped=False)
    assert status["lineage"] == ["u0", "u1"]
    assert "lineage" not in planner.status_completed(RESULT, NOW, stopped=False)


def test_restore_annotations() -> None:
    assert planner.restore_annotations("Restoring") == {
        protocol.ANNOTATION_RESTORE_PHASE: "Restoring", protocol.ANNOTATION_RESTORE_MESSAGE: None,
        protocol.ANNOTATION_RESTORE_RETRYABLE: None}
    failed = planner.restore_annotations("Failed", "bad\ndigest   here", retryable=False)
    assert failed[protocol.ANNOTATION_RESTORE_MESSAGE] == "bad digest here"
    assert failed[protocol.ANNOTATION_RESTORE_RETRYABLE] == "false"
    transient = planner.restore_annotations("Failed", "S3 unreachable", retryable=True)
    assert transient[protocol.ANNOTATION_RESTORE_RETRYABLE] == "true"
    with pytest.raises(ValueError):
        planner.restore_annotations("Maybe")


# -- Checkpoint status -----------------------------------------------------------------


def test_status_patches_follow_the_crd() -> None:
    dumping = planner.status_dumping(NODE, NOW)
    assert dumping == {"phase": "Dumping", "nodeName": NODE, "startedAt": "2026-01-02T03:04:05Z",
                       "progress": "dumping", "formatLevel": protocol.CHECKPOINT_FORMAT_LEVEL}
    uploading = planner.status_uploading(120, 100)
    assert uploading["progress"] == "uploading"
    progress = planner.status_progress(UploadProgress(2, 5, 8_000_000, 20_000_000, 1_000))
    assert progress == {"progress": "uploading 2/5 chunks (40%)"}
    completed = planner.status_completed(RESULT, NOW, stopped=True, seconds=1.84)
    # The printer columns' display fields, next to the exact numbers.
    assert (completed["size"], completed["duration"], completed["progress"]) == (
        "5.7 MiB", "1.8s", "5 chunks, 2 new")
    assert "duration" not in planner.status_completed(RESULT, NOW, stopped=True)
    assert completed["phase"] == "Completed"
    assert completed["manifestURI"] == RESULT.manifest_uri
    assert completed["manifestDigest"] == DIGEST
    assert completed["cpuFeatures"] == ["avx2", "sse4_2"]
    assert (completed["frozenMs"], completed["dumpMs"], completed["uploadMs"]) == (120, 100, 300)
    assert completed["completedAt"] == "2026-01-02T03:04:05Z"
    assert "ended" in completed["message"]
    # The format it is written in (issue 21): restores ask for a node that reads it.
    assert completed["formatLevel"] == protocol.CHECKPOINT_FORMAT_LEVEL == 2
    for doc in (with_status(dumping), with_status(dumping, uploading),
                with_status(dumping, uploading, progress),
                with_status(dumping, uploading, progress, completed),
                with_status(dumping, planner.status_failed("x", NOW, NODE))):
        assert schema_errors(doc) == []


def test_failed_status_has_a_short_one_line_message() -> None:
    failed = planner.status_failed("criu dump failed:\n  " + "x" * 5000, NOW, NODE)
    assert failed["phase"] == "Failed" and failed["nodeName"] == NODE
    assert "\n" not in failed["message"]
    assert len(failed["message"]) <= protocol.MESSAGE_LIMIT
    assert failed["message"].startswith("criu dump failed: xxx")
    assert failed["message"].endswith("...")


def test_image_digest_is_the_same_whatever_the_registry_name() -> None:
    assert planner.image_digest(f"docker.io/library/a@{IMAGE_DIGEST}") == IMAGE_DIGEST
    assert planner.image_digest(IMAGE_DIGEST) == IMAGE_DIGEST
    assert planner.image_digest("") is None


def test_schema_check_catches_a_bad_status() -> None:
    bad = planner.status_completed(RESULT, NOW, stopped=False)
    bad["manifestDigest"] = "md5:xyz"
    assert schema_errors(with_status(bad)) != []


# -- the agent applying these decisions (fake API, fake engines, fake /proc) -----------


def test_notice_taints_cordons_and_checkpoints_with_stop(tmp_path: Path) -> None:
    kube = FakeKube([pod("box-1")], [])
    engine = FakeEngine()
    agent = make_agent(tmp_path, kube, engine)
    agent.on_notice(notice())
    agent.shutdown()
    assert kube.node["spec"]["unschedulable"] is True
    assert kube.node["spec"]["taints"] == [planner.interruption_taint("spot-interruption")]
    [(target, stop)] = engine.calls
    assert stop is True
    assert engine.urgent == [True]  # ahead of routine uploads on the node's bandwidth
    assert (target.checkpoint, target.init_pid, target.sandbox_uid, target.image_digest) == (
        "box-1-preempt", 420, "sbx-uid", IMAGE_DIGEST)
    assert [(n, s["phase"]) for n, s in kube.statuses] == [
        ("box-1-preempt", "Dumping"), ("box-1-preempt", "Uploading"),
        ("box-1-preempt", "Completed")]
    # The format it is written in, from the claim on (a move's replacement pod asks for a
    # node that reads it) to the end (issue 21).
    assert [s.get("formatLevel") for _, s in kube.statuses] == [
        protocol.CHECKPOINT_FORMAT_LEVEL, None, protocol.CHECKPOINT_FORMAT_LEVEL]
    assert kube.checkpoints["box-1-preempt"]["status"]["formatLevel"] == 2


def test_progress_is_written_at_most_once_a_second_and_per_tenth() -> None:
    start = planner.ProgressMark(100.0, 0.0)
    assert not planner.progress_due(start, 100.5, 0.5)  # too soon
    assert not planner.progress_due(start, 101.0, 0.05)  # too little
    assert planner.progress_due(start, 101.0, 0.1)
    assert not planner.progress_due(planner.ProgressMark(101.0, 0.3), 105.0, 0.35)
    assert not planner.progress_due(start, 150.0, 1.0)  # the end is Completed's to write
    assert planner.upload_fraction(UploadProgress(1, 4, 0, 0, 0)) == 0.25
    assert planner.upload_fraction(UploadProgress(1, 4, 30, 40, 0)) == 0.75
    assert planner.upload_fraction(UploadProgress(0, 0, 0, 0, 0)) == 0.0


def test_upload_progress_reaches_the_status_throttled(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([float(t) for t in range(1000)])  # each reading is a second later
    monkeypatch.setattr("hermit_node.control.checkpointing.time.monotonic", lambda: next(clock))
    steps = [UploadProgress(n, 40, n * 100, 4000, n * 10) for n in (1, 2, 4, 8, 9, 20, 40)]
    kube = FakeKube([pod("box-1")], [ckpt("manual")])
    agent = make_agent(tmp_path, kube, FakeEngine(progress=steps))
    agent.reconcile_once()
    agent.shutdown()
    written = [s.get("progress") for n, s in kube.statuses if n == "manual"]
    assert written == ["dumping", "uploading", "uploading 4/40 chunks (10%)",
                       "uploading 8/40 chunks (20%)", "uploading 20/40 chunks (50%)",
                       "5 chunks, 2 new"]
    status = kube.checkpoints["manual"]["status"]
    assert (status["phase"], status["size"]) == ("Completed", "5.7 MiB")
    assert status["duration"].endswith("s")


def test_a_failed_progress_write_does_not_fail_the_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([float(t) for t in range(1000)])
    monkeypatch.setattr("hermit_node.control.checkpointing.time.monotonic", lambda: next(clock))
    kube = FakeKube([pod("box-1")], [ckpt("manual")])
    real = kube.patch_checkpoint_status

    def patch(namespace: str, name: str, status: dict[str, Any]) -> None:
        if "progress" in status and len(status) == 1:
            raise KubeTransient("HTTP 503")
        real(namespace, name, status)

    kube.patch_checkpoint_status = patch  # type: ignore[method-assign]
    agent = make_agent(tmp_path, kube, FakeEngine(progress=[UploadProgress(20, 40, 2, 4, 1)]))
    agent.reconcile_once()
    agent.shutdown()
    assert kube.checkpoints["manual"]["status"]["phase"] == "Completed"


class Watch:
    """A ``CaptureWatch`` that records what it was told, or fails when ``broken``."""

    def __init__(self, broken: bool = False) -> None:
        self.told: list[tuple[str, str, str]] = []
        self.broken = broken

    def captured(self, sp: Any, name: str, reason: str) -> None:
        self.told.append((sp.pod, name, reason))
        if self.broken:
            raise RuntimeError("a bug in the watch")


def test_the_capture_watch_is_told_each_checkpoints_capture_with_its_pod_and_reason(
        tmp_path: Path) -> None:
    kube = FakeKube([pod("box-1")], [ckpt("manual")])
    watch = Watch()
    agent = make_agent(tmp_path, kube, FakeEngine(), capture_watch=watch)
    agent.reconcile_once()
    agent.shutdown()
    assert watch.told == [("box-1", "manual", "Manual")]


def test_a_capture_watch_that_fails_does_not_fail_the_checkpoint(tmp_path: Path) -> None:
    kube = FakeKube([pod("box-1")], [ckpt("manual")])
    watch = Watch(broken=True)
    agent = make_agent(tmp_path, kube, FakeEngine(), capture_watch=watch)
    agent.reconcile_once()
    agent.shutdown()
    assert watch.told and kube.checkpoints["manual"]["status"]["phase"] == "Completed"


def advisory(kind: str = "rebalance-recommendation") -> Notice:
    return Notice(provider="aws", kind=kind, action="rebalance", deadline=None,
                  received_at=NOW, event_id="rebalance-recommendation")


def test_only_a_rebalance_recommendation_asks_for_an_early_checkpoint() -> None:
    assert advisory().asks_early_checkpoint and not advisory().is_interruption
    assert not notice().asks_early_checkpoint
    assert not advisory("scheduled-maintenance").asks_early_checkpoint


def test_early_requests_one_per_incarnation_none_while_one_is_in_flight() -> None:
    pods = sps(pod("a-1", sandbox="a"), pod("b-2", sandbox="b", incarnation=2),
               pod("c-1", sandbox="c"), pod("d-1", sandbox="d"),
               pod("e-1", sandbox="e", annotations={protocol.ANNOTATION_ON_PREEMPTION: "false"}),
               pod("f-1", sandbox="f", running=False))
    checkpoints = [
        ckpt("c-1-rebalance", sandbox="c", reason="Rebalance", status={"phase": "Completed"},
             incarnation=1),
        ckpt("d-1-i1", sandbox="d", reason="Interval", status={"phase": "Uploading"}),
        ckpt("a-1-i1", sandbox="a", reason="Interval", status={"phase": "Completed"}),
    ]
    assert [(sp.pod, named(sp, "Rebalance", tag))
            for sp, tag in planner.early_requests(pods, checkpoints)] == [
        ("a-1", "a-1-rebalance"), ("b-2", "b-2-rebalance")]
    # Not even a failed one is asked for again: the recommendation was acted upon.
    failed = ckpt("a-1-rebalance", sandbox="a", reason="Rebalance", status={"phase": "Failed"},
                  incarnation=1)
    assert [n for _, n in planner.early_requests(pods[:1], [failed])] == []
    assert planner.early_requests(pods, None) == []  # cannot tell: the caller retries


def test_rebalance_recommendation_checkpoints_every_sandbox_once_and_keeps_it_running(
        tmp_path: Path) -> None:
    kube = FakeKube([pod("box-1"), pod("cat-1", sandbox="cat")], [])
    engine = FakeEngine()
    agent = make_agent(tmp_path, kube, engine)
    agent.on_notice(advisory())
    agent.shutdown()
    assert kube.node["spec"] == {}  # advisory: no taint, no cordon
    assert sorted((t.checkpoint, stop) for t, stop in engine.calls) == [
        ("box-1-rebalance", False), ("cat-1-rebalance", False)]
    assert {n: c["spec"]["reason"] for n, c in kube.checkpoints.items()} == {
        "box-1-rebalance": "Rebalance", "cat-1-rebalance": "Rebalance"}
    assert all(c["status"]["phase"] == "Completed" for c in kube.checkpoints.values())
    # Once per recommendation: later loops ask for nothing more.
    kube.checkpoints.clear()
    agent.reconcile_once()
    agent.shutdown()
    assert kube.checkpoints == {} and len(engine.calls) == 2


def test_rebalance_requests_that_failed_are_made_on_the_next_loop(tmp_path: Path) -> None:
    kube = FakeKube([pod("box-1")], [])
    engine = FakeEngine()
    agent = make_agent(tmp_path, kube, engine)
    create = kube.create_checkpoint
    failing = [KubeTransient("creating Checkpoint agents/box-1-rebalance failed: HTTP 503")]

    def flaky(body: dict[str, Any], namespace: str) -> dict[str, Any]:
        if failing:
            raise failing.pop()
        return create(body, namespace)

    kube.create_checkpoint = flaky  # type: ignore[method-assign]
    agent.on_notice(advisory())
    assert kube.checkpoints == {}
    agent.reconcile_once()
    agent.shutdown()
    assert [t.checkpoint for t, _ in engine.calls] == ["box-1-rebalance"]


def test_no_early_checkpoint_once_an_interruption_notice_came(tmp_path: Path) -> None:
    kube = FakeKube([pod("box-1")], [])
    engine = FakeEngine()
    agent = make_agent(tmp_path, kube, engine)
    agent.on_notice(notice())
    agent.on_notice(advisory())
    agent.shutdown()
    assert sorted(kube.checkpoints) == ["box-1-preempt"]


def test_other_advisory_notices_do_nothing(tmp_path: Path) -> None:
    kube = FakeKube([pod("box-1")], [])
    engine = FakeEngine()
    agent = make_agent(tmp_path, kube, engine)
    agent.on_notice(Notice(provider="aws", kind="scheduled-maintenance", action="migrate",
                           deadline=None, received_at=NOW, event_id="m1"))
    agent.shutdown()
    assert kube.node["spec"] == {} and engine.calls == [] and kube.checkpoints == {}


def test_failed_checkpoint_reports_and_is_not_retried(tmp_path: Path) -> None:
    kube = FakeKube([pod("box-1")], [ckpt("manual")])
    engine = FakeEngine(CheckpointFailed("checkpoint agents/manual failed, sandbox left "
                                         "running: criu\ndump failed"))
    agent = make_agent(tmp_path, kube, engine)
    agent.reconcile_once()
    agent.shutdown()
    agent = make_agent(tmp_path / "again", kube, engine)
    agent.reconcile_once()  # status is Failed now: nothing to serve
    agent.shutdown()
    assert [(target.checkpoint, stop) for target, stop in engine.calls] == [("manual", False)]
    assert kube.checkpoints["manual"]["status"]["phase"] == "Failed"
    assert "\n" not in kube.checkpoints["manual"]["status"]["message"]
    assert kube.events == [("manual", "Warning", "CheckpointFailed")]


def test_api_errors_are_retried_on_the_next_loop(tmp_path: Path) -> None:
    kube = FakeKube([pod("box-1")], [ckpt("manual")])
    kube.fail_lists = 1
    engine = FakeEngine()
    agent = make_agent(tmp_path, kube, engine)
    agent.reconcile_once()  # logged, nothing raised
    agent.reconcile_once()
    agent.shutdown()
    assert [t.checkpoint for t, _ in engine.calls] == ["manual"]


def test_restore_annotates_and_expects_the_recorded_digest(tmp_path: Path) -> None:
    restoring = pod("box-2", incarnation=2,
                    annotations={protocol.ANNOTATION_RESTORE_FROM: "box-1-preempt"})
    kube = FakeKube([restoring], [ckpt("box-1-preempt", reason="Preemption", status={
        "phase": "Completed", "manifestDigest": DIGEST, "nodeName": "node-b"})])
    engine = FakeEngine()
    agent = make_agent(tmp_path, kube, engine)
    agent.reconcile_once()
    agent.shutdown()
    [(target, _)] = engine.calls
    assert (target.checkpoint, target.pin.digest, target.init_pid,
            target.sandbox) == ("box-1-preempt", DIGEST, 420, "box")
    assert [a[protocol.ANNOTATION_RESTORE_PHASE] for _, a in kube.annotations] == [
        "Restoring", "Restored"]


def test_refused_restore_is_failed_with_its_message(tmp_path: Path) -> None:
    restoring = pod("box-2", incarnation=2, annotations={protocol.ANNOTATION_RESTORE_FROM: "c1"})
    kube = FakeKube([restoring], [ckpt("c1", status={"phase": "Completed",
                                                      "manifestDigest": DIGEST})])
    engine = FakeEngine(CheckpointRefused("checkpoint agents/c1 needs CPU features this node "
                                          "lacks: avx512f"))
    agent = make_agent(tmp_path, kube, engine)
    agent.reconcile_once()
    agent.shutdown()
    phase, message = (kube.annotations[-1][1][protocol.ANNOTATION_RESTORE_PHASE],
                      kube.annotations[-1][1][protocol.ANNOTATION_RESTORE_MESSAGE])
    assert phase == "Failed" and message is not None and "avx512f" in message


def test_restart_fails_what_an_earlier_run_left_half_done(tmp_path: Path) -> None:
    stuck = pod("box-2", incarnation=2, annotations={
        protocol.ANNOTATION_RESTORE_FROM: "c1", protocol.ANNOTATION_RESTORE_PHASE: "Restoring"})
    kube = FakeKube([stuck], [ckpt("c0", status={"phase": "Dumping", "nodeName": NODE})])
    engine = FakeEngine()
    agent = make_agent(tmp_path, kube, engine)
    agent.reconcile_once()
    agent.shutdown()
    assert kube.checkpoints["c0"]["status"]["phase"] == "Failed"
    assert kube.annotations[0][1][protocol.ANNOTATION_RESTORE_PHASE] == "Failed"
    assert engine.calls == []


# -- drains, incarnation fences, restarts (issue: any number of moves) ------------------

def test_node_disruption_tells_a_notice_from_a_drain() -> None:
    assert planner.node_disruption({"spec": {}}) is None
    assert planner.node_disruption({"spec": {"unschedulable": True}}) == "Eviction"
    karpenter = {"spec": {"taints": [{"key": "karpenter.sh/disrupted",
                                      "effect": "NoSchedule"}]}}
    assert planner.node_disruption(karpenter) == "Eviction"
    nth = {"spec": {"taints": [{"key": "aws-node-termination-handler/spot-itn",
                                "effect": "NoSchedule"}]}}
    assert planner.node_disruption(nth) == "Eviction"
    ours = {"spec": {"unschedulable": True, "taints": [planner.interruption_taint("x")]}}
    assert planner.node_disruption(ours) == "Preemption"
    other = {"spec": {"taints": [{"key": "dedicated", "effect": "NoSchedule"}]}}
    assert planner.node_disruption(other) is None


def test_stop_checkpoint_names_keep_their_unique_tail() -> None:
    assert protocol.checkpoint_name("box", 3, protocol.EVICTION) == "box-3-evict"
    long = protocol.checkpoint_name("b" * 300, 12, protocol.PREEMPTION)
    assert len(long) == protocol.NAME_LIMIT and long.endswith("-12-preempt")


def test_a_request_for_an_older_incarnation_never_stops_the_new_pod() -> None:
    old = ckpt("box-1-preempt", reason="Preemption")
    old["metadata"]["labels"][protocol.LABEL_INCARNATION] = "1"
    mine = ckpt("box-2-evict", reason="Eviction")
    mine["metadata"]["labels"][protocol.LABEL_INCARNATION] = "2"
    unlabelled = ckpt("manual")
    current = sps(pod("box-2", incarnation=2))
    assert planner.checkpoints_to_serve([old], current) == []
    assert [c["metadata"]["name"] for c, _ in planner.checkpoints_to_serve(
        [old, mine], current)] == ["box-2-evict"]
    assert [c["metadata"]["name"] for c, _ in planner.checkpoints_to_serve(
        [unlabelled], current)] == ["manual"]


def test_pods_that_opted_out_are_not_checkpointed_on_a_notice() -> None:
    opted_out = pod("box-1", annotations={protocol.ANNOTATION_ON_PREEMPTION: "false"})
    other = pod("other-1", sandbox="other")
    assert [sp.pod for sp in planner.pods_to_checkpoint_on_notice(sps(opted_out, other))] == [
        "other-1"]


def test_completed_stop_of_matches_the_pods_incarnation_only() -> None:
    done = ckpt("box-1-preempt", reason="Preemption", status={"phase": "Completed"})
    done["metadata"]["labels"][protocol.LABEL_INCARNATION] = "1"
    [first] = sps(pod("box-1", incarnation=1))
    [second] = sps(pod("box-2", incarnation=2))
    assert planner.completed_stop_of([done], first) == "box-1-preempt"
    assert planner.completed_stop_of([done], second) is None
    routine = ckpt("box-i", reason="Interval", status={"phase": "Completed"})
    routine["metadata"]["labels"][protocol.LABEL_INCARNATION] = "1"
    assert planner.completed_stop_of([routine], first) is None


def test_a_cordoned_node_gets_eviction_checkpoints_without_a_taint(tmp_path: Path) -> None:
    kube = FakeKube([pod("box-1")], [])
    kube.node["spec"]["unschedulable"] = True  # kubectl drain / cordon
    engine = FakeEngine()
    agent = make_agent(tmp_path, kube, engine)
    agent.reconcile_once()
    agent.shutdown()
    assert "taints" not in kube.node["spec"]  # not ours to taint: nothing from the cloud
    [(target, stop)] = engine.calls
    assert target.checkpoint == "box-1-evict" and stop is True
    assert kube.checkpoints["box-1-evict"]["spec"]["reason"] == "Eviction"
    assert kube.checkpoints["box-1-evict"]["status"]["phase"] == "Completed"


def test_restart_completes_a_checkpoint_whose_manifest_is_durable(tmp_path: Path) -> None:
    uploading = ckpt("box-1-preempt", reason="Preemption",
                     status={"phase": "Uploading", "nodeName": NODE})
    uploading["metadata"]["labels"][protocol.LABEL_INCARNATION] = "1"
    lost = ckpt("manual", status={"phase": "Dumping", "nodeName": NODE})
    kube = FakeKube([pod("box-1")], [uploading, lost])
    trees = FakeTrees()
    agent = NodeAgent(NODE, kube, FakeEngine(), FakeEngine(), view=kube,  # type: ignore[arg-type]
                      stores=FakeStores(FakeManifests({"box-1-preempt"})), trees=trees,
                      proc_root=fake_proc(tmp_path), clock=lambda: NOW)
    agent.reconcile_once()
    agent.shutdown()
    done = kube.checkpoints["box-1-preempt"]["status"]
    assert done["phase"] == "Completed" and done["manifestDigest"] == DIGEST
    assert schema_errors(with_status(done)) == []
    assert kube.checkpoints["manual"]["status"]["phase"] == "Failed"
    # The frozen tree of incarnation 1 is ended, not thawed: its history went on in S3.
    assert trees.settled == [(420, True)]


def test_restart_thaws_a_tree_with_no_durable_stop(tmp_path: Path) -> None:
    kube = FakeKube([pod("box-1")], [])
    trees = FakeTrees()
    agent = NodeAgent(NODE, kube, FakeEngine(), FakeEngine(), view=kube,  # type: ignore[arg-type]
                      stores=FakeStores(FakeManifests(set())), trees=trees,
                      proc_root=fake_proc(tmp_path), clock=lambda: NOW)
    agent.reconcile_once()
    agent.shutdown()
    assert trees.settled == [(420, False)]


def test_restart_mid_restore_is_a_retryable_failure(tmp_path: Path) -> None:
    stuck = pod("box-2", incarnation=2, annotations={
        protocol.ANNOTATION_RESTORE_FROM: "c1", protocol.ANNOTATION_RESTORE_PHASE: "Restoring"})
    kube = FakeKube([stuck], [])
    agent = make_agent(tmp_path, kube, FakeEngine())
    agent.reconcile_once()
    agent.shutdown()
    assert kube.annotations[0][1][protocol.ANNOTATION_RESTORE_RETRYABLE] == "true"


def _cut_short(tmp_path: Path, left: str, *, lazy: bool = False
               ) -> tuple[FakeKube, FakeTrees, NodeAgent]:
    stuck = pod("box-2", incarnation=2, annotations={
        protocol.ANNOTATION_RESTORE_FROM: "c1", protocol.ANNOTATION_RESTORE_PHASE: "Restoring"})
    kube = FakeKube([stuck], [])
    trees = FakeTrees(left)
    engine = FakeEngine()
    engine.lazy = lazy
    agent = NodeAgent(NODE, kube, engine, engine, view=kube,  # type: ignore[arg-type]
                      trees=trees, proc_root=fake_proc(tmp_path), clock=lambda: NOW)
    return kube, trees, agent


def test_restart_after_criu_restored_the_tree_adopts_it(tmp_path: Path) -> None:
    """The agent died after CRIU finished (CRIU runs in the pod's cgroups and outlives it):
    the tree runs, so it is the sandbox. Failing it would give it a fresh pod beside it,
    and the same ticks would run twice (the fault suite's restore kills found this)."""
    kube, trees, agent = _cut_short(tmp_path, freezer.TREE_RESTORED)
    agent.reconcile_once()
    agent.shutdown()
    [(_, written)] = kube.annotations
    assert written[protocol.ANNOTATION_RESTORE_PHASE] == protocol.RESTORED
    assert "adopted" in written[protocol.ANNOTATION_RESTORE_MESSAGE]
    assert trees.ended == []


def test_restart_after_a_lazy_restore_ends_its_tree_then_fails_it(tmp_path: Path) -> None:
    """A lazy tree's pages were served by a daemon that died with the agent."""
    kube, trees, agent = _cut_short(tmp_path, freezer.TREE_RESTORED, lazy=True)
    agent.reconcile_once()
    agent.shutdown()
    assert trees.ended == [420]
    [(_, written)] = kube.annotations
    assert written[protocol.ANNOTATION_RESTORE_PHASE] == protocol.RESTORE_FAILED
    assert written[protocol.ANNOTATION_RESTORE_RETRYABLE] == "true"


def test_restart_while_criu_still_restores_waits_for_it(tmp_path: Path) -> None:
    kube, trees, agent = _cut_short(tmp_path, freezer.CRIU_AT_WORK)
    agent.reconcile_once()
    assert kube.annotations == [] and trees.ended == []
    trees.left = freezer.TREE_RESTORED  # CRIU finished
    agent.reconcile_once()
    agent.shutdown()
    [(_, written)] = kube.annotations
    assert written[protocol.ANNOTATION_RESTORE_PHASE] == protocol.RESTORED


def test_a_cut_short_restore_is_adopted_ended_failed_or_waited_for() -> None:
    decide = planner.cut_short_restore
    assert decide(freezer.TREE_RESTORED, lazy=False, waited=0) == planner.ADOPT
    assert decide(freezer.TREE_RESTORED, lazy=True, waited=0) == planner.END
    assert decide(freezer.NOTHING_RESTORED, lazy=False, waited=0) == planner.FAIL
    assert decide(freezer.CRIU_AT_WORK, lazy=False, waited=59, patience=60) is None
    assert decide(freezer.CRIU_AT_WORK, lazy=False, waited=61, patience=60) == planner.END


def test_completed_is_retried_until_it_lands_before_the_tree_is_killed(
        tmp_path: Path) -> None:
    kube = FakeKube([pod("box-1")], [])
    failures = {"left": 3}
    real_patch = kube.patch_checkpoint_status

    def flaky(namespace: str, name: str, status: dict[str, Any]) -> None:
        if status.get("phase") == "Completed" and failures["left"]:
            failures["left"] -= 1
            raise KubeTransient("the API server is busy: HTTP 429", status=429)
        real_patch(namespace, name, status)

    kube.patch_checkpoint_status = flaky  # type: ignore[method-assign]
    agent = make_agent(tmp_path, kube, FakeEngine())
    agent.on_notice(notice())
    agent.shutdown()
    assert failures["left"] == 0
    assert kube.checkpoints["box-1-preempt"]["status"]["phase"] == "Completed"


def test_refused_restore_is_not_retryable(tmp_path: Path) -> None:
    restoring = pod("box-2", incarnation=2, annotations={protocol.ANNOTATION_RESTORE_FROM: "c1"})
    kube = FakeKube([restoring], [ckpt("c1", status={"phase": "Completed",
                                                      "manifestDigest": DIGEST})])
    agent = make_agent(tmp_path, kube, FakeEngine(CheckpointRefused("chunk 00ab is corrupt")))
    agent.reconcile_once()
    agent.shutdown()
    assert kube.annotations[-1][1][protocol.ANNOTATION_RESTORE_RETRYABLE] == "false"
    kube2 = FakeKube([restoring], [ckpt("c1", status={"phase": "Completed",
                                                       "manifestDigest": DIGEST})])
    agent = make_agent(tmp_path / "b", kube2, FakeEngine(RestoreFailed("S3 unreachable")))
    agent.reconcile_once()
    agent.shutdown()
    assert kube2.annotations[-1][1][protocol.ANNOTATION_RESTORE_RETRYABLE] == "true"


def test_a_checkpoint_of_a_newer_format_is_never_handed_to_criu_and_may_restore_elsewhere(
        tmp_path: Path) -> None:
    """A node mislabelled with a format it does not read (issue 21): the restore fails
    retryable, so the operator tries the same checkpoint on another node, never an older."""
    newer = protocol.CHECKPOINT_FORMAT_LEVEL + 1
    assert planner.unreadable_format({"status": {"formatLevel": newer}}, "c1") is not None
    for level in (None, 1, protocol.CHECKPOINT_FORMAT_LEVEL):
        assert planner.unreadable_format({"status": {"formatLevel": level}}, "c1") is None
    restoring = pod("box-2", incarnation=2, annotations={protocol.ANNOTATION_RESTORE_FROM: "c1"})
    kube = FakeKube([restoring], [ckpt("c1", status={"phase": "Completed", "formatLevel": newer,
                                                      "manifestDigest": DIGEST})])
    engine = FakeEngine()
    agent = make_agent(tmp_path, kube, engine)
    agent.reconcile_once()
    agent.shutdown()
    written = kube.annotations[-1][1]
    assert written[protocol.ANNOTATION_RESTORE_PHASE] == protocol.RESTORE_FAILED
    assert written[protocol.ANNOTATION_RESTORE_RETRYABLE] == "true"
    assert f"checkpoint format {newer}" in str(written[protocol.ANNOTATION_RESTORE_MESSAGE])
    assert engine.calls == []


def test_a_failed_stopping_request_is_made_again_while_the_node_goes_away() -> None:
    pods = sps(pod("box-1"))

    def asked(reason: str, checkpoints: list[dict[str, Any]] | None) -> list[str]:
        return [named(sp, reason, t) for sp, t in planner.stop_requests(pods, reason,
                                                                         checkpoints)]

    assert asked("Preemption", []) == ["box-1-preempt"]
    failed = ckpt("box-1-preempt", reason="Preemption", status={"phase": "Failed"},
                  incarnation=1)
    assert asked("Preemption", [failed]) == ["box-1-preempt-r2"]
    running = ckpt("box-1-preempt-r2", reason="Preemption", status={"phase": "Uploading"},
                   incarnation=1)
    assert planner.stop_requests(pods, "Preemption", [failed, running]) == []
    every = [ckpt("box-1-preempt" + (f"-r{n}" if n > 1 else ""), reason="Preemption",
                  status={"phase": "Failed"}, incarnation=1)
             for n in range(1, planner.STOP_ATTEMPTS + 1)]
    assert planner.stop_requests(pods, "Preemption", every) == []
    # Without a list (the API did not answer) only the first request is (re)made.
    assert asked("Eviction", None) == ["box-1-evict"]


def test_a_stopping_request_is_found_by_its_labels_whatever_its_name() -> None:
    """A request made under the longer name (another node took the protocol's: requests.py)
    counts as the request; one of another incarnation, sandbox or reason does not."""
    pods = sps(pod("box-1"))
    tagged = ckpt("box-1-preempt-0a1b2c3d", reason="Preemption", incarnation=1)
    assert planner.stop_requests(pods, "Preemption", [tagged]) == []
    others = [ckpt("box-0-preempt", reason="Preemption", incarnation=0),
              ckpt("cat-1-preempt", sandbox="cat", reason="Preemption", incarnation=1),
              ckpt("box-1-evict", reason="Eviction", incarnation=1)]
    assert [t for _, t in planner.stop_requests(pods, "Preemption", others)] == [""]
    failed = {**tagged, "status": {"phase": "Failed"}}
    assert [t for _, t in planner.stop_requests(pods, "Preemption", [failed])] == ["-r2"]


def test_a_failed_stopping_request_is_made_again_only_after_a_growing_backoff() -> None:
    """An unreachable store fails a request within a second: the retries are spaced
    (1, 2, 4, then 8 s) so that a short outage is outlived, not every attempt burnt."""
    pods = sps(pod("box-1"))
    at = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)

    def failed(name: str) -> dict[str, Any]:
        return ckpt(name, reason="Preemption",
                    status={"phase": "Failed", "completedAt": "2026-12-01T12:00:00Z"},
                    incarnation=1)

    def asked(checkpoints: list[dict[str, Any]], seconds: float) -> list[str]:
        return [named(sp, "Preemption", t) for sp, t in planner.stop_requests(
            pods, "Preemption", checkpoints, at + timedelta(seconds=seconds))]

    first = [failed("box-1-preempt")]
    assert planner.stop_requests(pods, "Preemption", first, at + timedelta(seconds=0.5)) == []
    assert asked(first, 1) == ["box-1-preempt-r2"]
    four = [failed("box-1-preempt" + (f"-r{n}" if n > 1 else "")) for n in range(1, 5)]
    assert planner.stop_requests(pods, "Preemption", four, at + timedelta(seconds=7)) == []
    assert asked(four, 8) == ["box-1-preempt-r5"]
    assert [planner.stop_backoff(n) for n in (1, 2, 3, 4, 9)] == [1.0, 2.0, 4.0, 8.0, 8.0]


def test_the_next_stopping_request_follows_the_highest_made_when_old_ones_were_deleted(
) -> None:
    """Retention deletes the oldest Failed requests (keeping ``retain`` of them): after the
    4th failed with the 1st deleted, the next is ``-r5``, not ``-r4`` again (a create of an
    existing name answers with that Failed request, and no request was ever made again:
    a sandbox restarted from scratch in CI)."""
    pods = sps(pod("box-1"))
    at = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
    left = [ckpt(f"box-1-preempt-r{n}", reason="Preemption", incarnation=1,
                 status={"phase": "Failed", "completedAt": "2026-12-01T12:00:00Z"})
            for n in (2, 3, 4)]
    assert planner.stop_requests(pods, "Preemption", left, at + timedelta(seconds=7)) == []
    assert [t for _, t in planner.stop_requests(
        pods, "Preemption", left, at + timedelta(seconds=8))] == ["-r5"]
    last = [ckpt(f"box-1-preempt-r{planner.STOP_ATTEMPTS}-0a1b2c3d", reason="Preemption",
                 incarnation=1, status={"phase": "Failed"})]
    assert planner.stop_requests(pods, "Preemption", last) == []
    assert [planner.request_attempt(ckpt(n)) for n in (
        "box-1-preempt", "box-1-preempt-0a1b2c3d", "box-r7-1-evict", "box-1-evict-r3",
        "box-1-preempt-r12-0a1b2c3d")] == [1, 1, 1, 3, 12]


def test_dumping_status_records_the_checkpoint_the_pod_was_restored_from() -> None:
    restored = planner.status_dumping(NODE, NOW, parent="box-1-preempt")
    assert restored == {"phase": "Dumping", "nodeName": NODE, "progress": "dumping",
                        "startedAt": "2026-01-02T03:04:05Z", "parent": "box-1-preempt",
                        "formatLevel": protocol.CHECKPOINT_FORMAT_LEVEL}
    assert "parent" not in planner.status_dumping(NODE, NOW, parent=None)
    assert "parent" not in planner.status_dumping(NODE, NOW)
    # The value the agent passes: the pod's restore-from annotation, None on a fresh pod.
    sp = planner.sandbox_pod(pod("box-2", incarnation=2, annotations={
        protocol.ANNOTATION_RESTORE_FROM: "box-1-preempt",
        protocol.ANNOTATION_RESTORE_PHASE: protocol.RESTORED}))
    assert sp is not None
    assert planner.status_dumping(NODE, NOW, sp.restore_from)["parent"] == "box-1-preempt"
    fresh = planner.sandbox_pod(pod("box-1"))
    assert fresh is not None and fresh.restore_from is None
    assert schema_errors(with_status(restored)) == []
    assert schema_errors(with_status(restored, planner.status_uploading(120, 100),
                                      planner.status_completed(RESULT, NOW, stopped=False))) == []


class InheritingStore:
    """A store that records the data-key inheritance a fork's restore asks for."""

    def __init__(self) -> None:
        self.inherited: list[tuple[Any, ...]] = []

    def inherit_data_key(self, source: Any, heir: Any, namespace: str, sandbox: str,
                         sandbox_uid: str) -> bool:
        self.inherited.append((source, heir, namespace, sandbox, sandbox_uid))
        return True


def test_a_restore_expects_the_recorded_parent_and_lineage_and_a_fork_inherits_its_key(
        tmp_path: Path) -> None:
    fork = pod("fork-1", sandbox="fork", annotations={protocol.ANNOTATION_RESTORE_FROM: "box-3"})
    kube = FakeKube([fork], [ckpt("box-3", status={
        "phase": "Completed", "manifestDigest": DIGEST, "parent": "box-2",
        "lineage": ["uid-of-box"]})])
    engine = FakeEngine()
    store = InheritingStore()
    agent = NodeAgent(NODE, kube, engine, engine, stores=FakeStores(store), view=kube,  # type: ignore[arg-type]
                      proc_root=fake_proc(tmp_path), clock=lambda: NOW)
    agent.reconcile_once()
    agent.shutdown()
    [(target, _)] = engine.calls
    assert (target.sandbox, target.pin.uid, target.pin.parent, target.pin.lineage) \
        == ("box", "uid-of-box", "box-2", ("uid-of-box",))
    assert store.inherited == [(
        Pin("agents", "box", "box-3", "uid-of-box", "box-2", ("uid-of-box",), DIGEST),
        store, "agents", "fork", "sbx-uid")]
    assert kube.annotations[-1][1][protocol.ANNOTATION_RESTORE_PHASE] == "Restored"


# -- the job queue ------------------------------------------------------------------------

def test_jobs_run_the_most_urgent_first_and_freeze_at_most_two_at_once() -> None:
    jobs = jobs_module.Jobs(workers=3, freezing=2)
    gate = threading.Event()
    lock = threading.Lock()
    order: list[str] = []
    frozen = [0, 0]  # now, at most

    def job(name: str, freezes: bool) -> Callable[[], None]:
        def run() -> None:
            with lock:
                order.append(name)
                frozen[0] += freezes
                frozen[1] = max(frozen[1], frozen[0])
            gate.wait(10)
            with lock:
                frozen[0] -= freezes
        return run

    # A routine checkpoint occupies a worker and a freezing slot; the rest queue behind it.
    assert jobs.submit(("ns", "r1"), job("r1", True), priority=jobs_module.PRIORITY_ROUTINE,
                       freezes=True)
    wait_until("r1 run", 10.0, lambda: order == ["r1"], 0.01)
    assert jobs.submit(("ns", "r2"), job("r2", True), priority=jobs_module.PRIORITY_ROUTINE,
                       freezes=True)
    assert jobs.submit(("ns", "s1"), job("s1", True), priority=jobs_module.PRIORITY_STOPPING,
                       freezes=True)
    assert jobs.submit(("ns", "s2"), job("s2", True), priority=jobs_module.PRIORITY_STOPPING,
                       freezes=True)
    assert jobs.submit(("ns", "x1"), job("x1", False), priority=jobs_module.PRIORITY_RESTORE)
    # One job per sandbox: a second one for a queued sandbox is refused.
    assert not jobs.submit(("ns", "s2"), job("s2-again", True),
                           priority=jobs_module.PRIORITY_STOPPING)
    # The urgent one takes the free freezing slot; the restore (no freezing) the last worker.
    wait_until("r1, s1 and x1 run", 10.0, lambda: sorted(order) == ["r1", "s1", "x1"], 0.01)
    gate.set()
    jobs.shutdown()
    assert sorted(order[3:]) == ["r2", "s2"]
    assert frozen[1] == 2
    assert not jobs.submit(("ns", "late"), job("late", False))  # shut down


def test_jobs_queue_in_priority_then_submission_order() -> None:
    jobs = jobs_module.Jobs(workers=1, freezing=1)
    gate = threading.Event()
    order: list[str] = []

    def first() -> None:
        order.append("first")
        gate.wait(10)

    jobs.submit(("ns", "first"), first)
    wait_until("the first run", 10.0, lambda: order == ["first"], 0.01)
    for name, priority in (("routine-1", jobs_module.PRIORITY_ROUTINE),
                           ("restore", jobs_module.PRIORITY_RESTORE),
                           ("stop-1", jobs_module.PRIORITY_STOPPING),
                           ("routine-2", jobs_module.PRIORITY_ROUTINE),
                           ("stop-2", jobs_module.PRIORITY_STOPPING)):
        jobs.submit(("ns", name), functools.partial(order.append, name), priority=priority,
                    freezes=True)
    gate.set()
    jobs.shutdown()
    assert order == ["first", "stop-1", "stop-2", "restore", "routine-1", "routine-2"]


def test_library_loggers_stay_at_info_when_hermit_logs_debug() -> None:
    try:
        node_main.set_log_levels("DEBUG")
        assert logging.getLogger("hermit_node").getEffectiveLevel() == logging.DEBUG
        assert logging.getLogger("botocore.hooks").getEffectiveLevel() == logging.INFO
        node_main.set_log_levels("WARNING")
        assert logging.getLogger("urllib3.connectionpool").getEffectiveLevel() == logging.WARNING
    finally:
        node_main.set_log_levels("INFO")


def test_a_durable_checkpoint_frees_its_freezing_slot_before_its_job_ends() -> None:
    jobs = jobs_module.Jobs(workers=2, freezing=1)
    cleaning, started = threading.Event(), threading.Event()

    def first() -> None:
        jobs.unfrozen()  # durable: only the cleanup is left
        cleaning.wait(10)

    jobs.submit(("ns", "a"), first, priority=jobs_module.PRIORITY_STOPPING, freezes=True)
    jobs.submit(("ns", "b"), started.set, priority=jobs_module.PRIORITY_STOPPING, freezes=True)
    assert started.wait(10)  # while the first one still cleans up
    cleaning.set()
    jobs.shutdown()
    jobs.unfrozen()  # outside a job: nothing


class _Uploaded:
    """The rest of a ``CheckpointProgress`` whose ``uploading`` was told already."""

    def __init__(self, progress: Any) -> None:
        self._progress = progress

    def captured(self) -> None:
        pass

    def uploading(self, frozen_ms: int, dump_ms: int) -> None:
        pass

    def progressed(self, progress: Any) -> None:
        self._progress.progressed(progress)

    def durable(self, result: CheckpointResult) -> None:
        self._progress.durable(result)


class BlockingEngine(FakeEngine):
    """Blocks a routine checkpoint in its upload (after progress.uploading) until released."""

    def __init__(self) -> None:
        super().__init__()
        self.uploading, self.release = threading.Event(), threading.Event()

    def checkpoint(self, target: Any, *, stop: bool = False, **kwargs: Any) -> CheckpointResult:
        if not stop:
            progress = kwargs.pop("progress")
            progress.captured()
            progress.uploading(5, 4)
            kwargs["progress"] = _Uploaded(progress)
            self.uploading.set()
            self.release.wait(10)
        return super().checkpoint(target, stop=stop, **kwargs)


def test_a_routine_upload_leaves_its_slot_to_a_notices_checkpoint(tmp_path: Path) -> None:
    kube = FakeKube([pod("box-1"), pod("cat-1", sandbox="cat")],
                    [ckpt("manual", sandbox="cat")])
    engine = BlockingEngine()
    agent = NodeAgent(NODE, kube, engine, engine,  # type: ignore[arg-type]
                      view=kube, proc_root=fake_proc(tmp_path), clock=lambda: NOW,
                      jobs=jobs_module.Jobs(workers=2, freezing=1))
    agent.reconcile_once()
    assert engine.uploading.wait(10)
    agent.on_notice(notice())  # box-1's Preemption checkpoint takes the only slot
    wait_until("box-1's Preemption checkpoint Completed", 10.0, lambda: (
        kube.checkpoints.get("box-1-preempt") or {}).get("status", {}).get("phase")
        == "Completed", 0.01)
    engine.release.set()
    agent.shutdown()
    assert kube.checkpoints["manual"]["status"]["phase"] == "Completed"


def test_a_stopping_request_for_a_busy_sandbox_promotes_its_routine_upload(
        tmp_path: Path) -> None:
    """One job per sandbox: its stopping checkpoint waits for the routine one that runs,
    so that one's upload is promoted to urgent on the node's bandwidth."""
    from hermit_node.control import jobs as jobs_module

    class BusyJobs:
        def submit(self, key: Any, fn: Any, *, priority: int, freezes: bool = False) -> bool:
            return False  # a job for the sandbox runs

        def unfrozen(self) -> None:
            pass

    limiter = mock.Mock()
    kube = FakeKube([pod("box-1")], [])
    agent = NodeAgent(NODE, kube, FakeEngine(), FakeEngine(),  # type: ignore[arg-type]
                      view=kube, proc_root=fake_proc(tmp_path), clock=lambda: NOW,
                      jobs=BusyJobs(), limiter=limiter)  # type: ignore[arg-type]
    agent._taken.start("u1", ("ns", "sb"), lambda: None, priority=jobs_module.PRIORITY_ROUTINE)
    limiter.promote.assert_not_called()
    agent._taken.start("u2", ("ns", "sb"), lambda: None, priority=jobs_module.PRIORITY_STOPPING)
    limiter.promote.assert_called_once_with(("ns", "sb"))


def test_a_checkpoint_without_a_namespace_is_in_default_everywhere() -> None:
    """One rule for a missing namespace (CheckpointView), as for a pod (sandbox_pod)."""
    from hermit_node.control import collect
    obj = {"metadata": {"name": "c", "resourceVersion": "7"},
           "spec": {"sandboxRef": {"name": "s"}}, "status": {"phase": protocol.DUMPING}}
    view = planner.CheckpointView.from_object(obj)
    assert view.key == ("default", "c") and view.sandbox_key == ("default", "s")
    assert view.taken and view.resource_version == "7"
    assert collect.kept_checkpoints([obj], "default", "s") == {"c"}
    assert collect.kept_checkpoints([obj], "", "s") == set()
    assert planner.restore_sources_to_read([], [obj]) == []
