"""S3 garbage collection decisions (gc.py, collect.py) and the upload deadline."""

from __future__ import annotations

from typing import Any

import pytest

from hermit_common import gc, protocol
from hermit_common.gc import CollectResult
from hermit_common.settings import NodeSettings
from hermit_node.control import collect, planner
from tests.support.node_agent import ckpt, pod, sps


def test_doomed_keeps_what_is_kept_and_what_is_young() -> None:
    stored = {"a": 10.0, "b": 5000.0, "c": None, "d": 4000.0}
    assert gc.doomed(stored, {"d"}, 3600) == ["b", "c"]  # unknown age counts as old
    assert gc.doomed(stored, {"d"}, 0) == ["a", "b", "c"]
    assert gc.doomed(stored, set(), 10_000) == ["c"]
    assert CollectResult(("m",), ("x", "y")).deleted == 3


def test_kept_checkpoints_are_every_existing_checkpoint_of_the_sandbox() -> None:
    cks = [ckpt("box-1", status={"phase": "Completed"}), ckpt("box-2"),
           ckpt("box-3", status={"phase": "Failed"}),
           ckpt("other-1", sandbox="other"), ckpt("box-x", namespace="elsewhere")]
    assert collect.kept_checkpoints(cks, "agents", "box") == {"box-1", "box-2", "box-3"}


def test_others_in_flight_block_collection() -> None:
    cks = [ckpt("box-1", status={"phase": protocol.UPLOADING}),
           ckpt("box-2", status={"phase": protocol.DUMPING}), ckpt("box-3"),
           ckpt("other-1", sandbox="other", status={"phase": protocol.DUMPING})]
    assert collect.others_in_flight(cks, "agents", "box", "box-1") == ["box-2"]
    assert collect.others_in_flight(cks[2:], "agents", "box", "box-1") == []


def test_recorded_means_the_operator_made_it_last_checkpoint() -> None:
    assert collect.recorded({"status": {"lastCheckpoint": {"name": "c2"}}}, "c2")
    assert not collect.recorded({"status": {"lastCheckpoint": {"name": "c1"}}}, "c2")
    assert not collect.recorded(None, "c2")


def test_still_serving_needs_the_same_running_pod() -> None:
    sp = sps(pod("box-1"))[0]
    assert collect.still_serving(sps(pod("box-1")), sp)
    assert not collect.still_serving(sps(pod("box-1", terminating=True)), sp)
    assert not collect.still_serving([], sp)
    assert not collect.still_serving(sps(pod("box-2", incarnation=2)), sp)


class _Kube:
    def __init__(self, checkpoints: list[dict[str, Any]], pods: list[dict[str, Any]]) -> None:
        self.checkpoints, self.pods = checkpoints, pods

    def get_sandbox(self, namespace: str, name: str) -> dict[str, Any]:
        return {"status": {"lastCheckpoint": {"name": "box-3"}}}

    def list_checkpoints(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return self.checkpoints

    def list_node_pods(self) -> list[dict[str, Any]]:
        return self.pods


class _Store:
    def __init__(self) -> None:
        self.calls: list[tuple[set[str], float, bool]] = []

    def collect(self, namespace: str, sandbox: str, *, keep: set[str], min_age_seconds: float,
                may_delete: Any) -> CollectResult:
        self.calls.append((keep, min_age_seconds, may_delete()))
        return CollectResult()


def _run(kube: _Kube, halted: bool = False) -> _Store:
    store = _Store()
    c = collect.Collector(kube, min_age_seconds=60.0, settle_seconds=5.0)  # type: ignore[arg-type]
    c.after_checkpoint("box-3", sps(pod("box-1"))[0], store,  # type: ignore[arg-type]
                       lambda: halted)
    return store


def test_collector_keeps_existing_checkpoints_and_checks_the_pod_per_batch() -> None:
    cks = [ckpt("box-2", status={"phase": "Completed"}),
           ckpt("box-3", status={"phase": "Completed"})]
    assert _run(_Kube(cks, [pod("box-1")])).calls == [({"box-2", "box-3"}, 60.0, True)]
    # The pod went away meanwhile: no delete request is made.
    assert _run(_Kube(cks, [])).calls == [({"box-2", "box-3"}, 60.0, False)]


def test_collector_does_not_run_while_another_checkpoint_is_written_or_halted() -> None:
    busy = [ckpt("box-4", status={"phase": protocol.UPLOADING})]
    assert _run(_Kube(busy, [pod("box-1")])).calls == []
    assert _run(_Kube([], [pod("box-1")]), halted=True).calls == []


@pytest.mark.parametrize(("notice", "reason", "routine", "expected"), [
    (500.0, "Interval", 900.0, 500.0),  # a notice bounds everything
    (500.0, "Preemption", None, 500.0),
    (None, "Interval", 900.0, 1000.0),
    (None, "Manual", 900.0, 1000.0),
    (None, "Turn", 900.0, 1000.0),
    (None, "Suspend", 900.0, None),  # stopping: it keeps trying while the sandbox waits
    (None, "Eviction", 900.0, None),
    (None, "Interval", None, None),
])
def test_upload_deadline(notice: float | None, reason: str, routine: float | None,
                         expected: float | None) -> None:
    assert planner.upload_deadline(notice, 100.0, reason, routine) == expected


def test_gc_and_upload_settings() -> None:
    base = {"HERMIT_NODE_NAME": "n", "HERMIT_S3_BUCKET": "b"}
    s = NodeSettings.from_env(base)
    assert (s.gc_enabled, s.gc_min_age_seconds, s.routine_upload_seconds) == (True, 3600.0,
                                                                             900.0)
    s = NodeSettings.from_env({**base, "HERMIT_GC_ENABLED": "false",
                               "HERMIT_GC_MIN_AGE_SECONDS": "0",
                               "HERMIT_ROUTINE_UPLOAD_SECONDS": "60"})
    assert (s.gc_enabled, s.gc_min_age_seconds, s.routine_upload_seconds) == (False, 0.0, 60.0)
    with pytest.raises(Exception, match="HERMIT_ROUTINE_UPLOAD_SECONDS"):
        NodeSettings.from_env({**base, "HERMIT_ROUTINE_UPLOAD_SECONDS": "1"})
