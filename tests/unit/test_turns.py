"""Turn boundaries: the inspector's decision, the /proc parsers, request validation and the
turn service against a fake API (docs/turns.md)."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hermit_common import protocol
from hermit_node.control import planner
from hermit_node.control.planner import SandboxPod
from hermit_node.engine import inspector, snapshot
from hermit_node.engine.inspector import FileSig, Proc, Snapshot
from hermit_node.turns import turns
from tests.support.crds import schema_errors
from tests.support.node_agent import NODE, ckpt, pod
from tests.support.turns import AGENT, INIT, PATH, SIG, THAWED, FakeKube, post, service, snap

# -- the decision ------------------------------------------------------------------------------

def test_nothing_changed_is_a_skip() -> None:
    assert inspector.decide(snap(), snap()).decision == protocol.TURN_SKIP


def test_no_baseline_is_full_and_says_why() -> None:
    d = inspector.decide(None, snap(), baseline_note="the last turn checkpoint x is gone")
    assert (d.decision, d.reasons) == (protocol.TURN_FULL, ("the last turn checkpoint x is gone",))


@pytest.mark.parametrize("after, words", [
    (snap(files={"rootfs": {"etc/x": SIG}, "workspace": {"a.txt": replace(SIG, mtime_ns=2)}}),
     "workspace: 1 changed (a.txt)"),
    (snap(files={"rootfs": {"etc/x": SIG}, "workspace": {"a.txt": SIG, "b": SIG}}),
     "workspace: 1 added (b)"),
    (snap(files={"rootfs": {}, "workspace": {"a.txt": SIG}}), "rootfs: 1 removed (etc/x)"),
    (snap(files={"rootfs": {"etc/x": replace(SIG, kind_mode=0o100755)},
                 "workspace": {"a.txt": SIG}}), "rootfs: 1 changed"),
    (snap(files={"rootfs": {"etc/x": replace(SIG, inode=101)}, "workspace": {"a.txt": SIG}}),
     "rootfs: 1 changed"),
])
def test_only_files_changed_is_files_only(after: Snapshot, words: str) -> None:
    d = inspector.decide(snap(), after)
    assert d.decision == protocol.TURN_FILES_ONLY
    assert any(words in r for r in d.reasons), d.reasons


@pytest.mark.parametrize("after, words", [
    (snap(procs=(INIT, AGENT, Proc(9, 70, "/bin/sh", ("sh",), (1,) * 7, (0, 0, 1, 1, 0)))),
     "processes started: 9"),
    (snap(procs=(INIT,)), "processes ended: 7"),
    (snap(procs=(INIT, replace(AGENT, start_ticks=61))), "processes started: 7"),
    (snap(procs=(INIT, replace(AGENT, cmdline=("sleep", "5")))), "processes started: 7"),
    (snap(procs=(INIT, replace(AGENT, memory=(2000, 504, 104, 400, 0, 300, 0))))
     , "memory counters changed: pids 7"),
    (snap(procs=(INIT, replace(AGENT, activity=(3, 1, 1, 3, 0)))), "processes ran: pids 7"),
    (snap(sockets=frozenset()), "listening sockets closed: tcp 00000000:1B58"),
    (snap(sockets=frozenset({"tcp 00000000:1B58", "unix @x"})), "listening sockets opened"),
    (snap(unreadable=("workspace: Permission denied",)), "not readable: workspace"),
])
def test_processes_sockets_memory_or_doubt_is_full(after: Snapshot, words: str) -> None:
    d = inspector.decide(snap(), after)
    assert d.decision == protocol.TURN_FULL
    assert any(words in r for r in d.reasons), d.reasons


def test_hermit_init_waking_up_is_not_a_change_but_its_memory_is() -> None:
    woke = replace(INIT, activity=(5, 3, 1, 99, 0))
    assert inspector.decide(snap(), snap(procs=(woke, AGENT))).decision == protocol.TURN_SKIP
    grew = replace(INIT, memory=(900, 4, 0, 0, 0, 4, 0))
    assert inspector.decide(snap(), snap(procs=(grew, AGENT))).decision == protocol.TURN_FULL


def test_files_and_processes_is_full_with_both_reasons() -> None:
    after = snap(files={"rootfs": {}, "workspace": {"a.txt": SIG}}, procs=(INIT,))
    d = inspector.decide(snap(), after)
    assert d.decision == protocol.TURN_FULL
    assert any("rootfs" in r for r in d.reasons) and any("ended" in r for r in d.reasons)


def test_reasons_name_a_few_paths_and_count_the_rest() -> None:
    many = {f"f{i}": SIG for i in range(10)}
    d = inspector.decide(snap(files={"rootfs": {}}), snap(files={"rootfs": many}))
    assert d.reasons == ("rootfs: 10 added (f0, f1, f2 and 7 more)",)


# -- reading /proc (the pure parts of the adapter) ----------------------------------------------

def test_proc_parsers() -> None:
    stat = "7 (a b) c) S 1 7 7 0 -1 4194560 100 0 0 0 12 34 0 0 20 0 1 0 5555 1000 200"
    assert snapshot.stat_fields(stat) == (12, 34, 5555)
    status = "Name:\tsleep\nVmRSS:\t  512 kB\nThreads:\t1\nvoluntary_ctxt_switches:\t3\n"
    assert snapshot.status_fields(status) == {"VmRSS": 512, "Threads": 1,
                                              "voluntary_ctxt_switches": 3}


def test_listening_sockets() -> None:
    tcp = ("  sl  local_address rem_address   st\n"
           "   0: 00000000:1B58 00000000:0000 0A 0\n"
           "   1: 0100007F:9C40 0100007F:1B58 01 0\n")
    unix = ("Num       RefCount Protocol Flags    Type St Inode Path\n"
            "0000: 00000002 00000000 00010000 0001 01 123 @/tmp/srv\n"
            "0000: 00000002 00000000 00000000 0001 03 124\n")
    assert snapshot.listening({"tcp": tcp, "unix": unix}) == frozenset(
        {"tcp 00000000:1B58", "unix @/tmp/srv"})


def _thread_states(proc: Path, states: dict[int, str]) -> None:
    for tid, state in states.items():
        task = proc / "7" / "task" / str(tid)
        task.mkdir(parents=True, exist_ok=True)
        (task / "stat").write_text(f"{tid} (agent) {state} 1 7 7 0 -1 0 0 0 0 0 1 1 0 0")


def test_a_frozen_read_waits_until_no_thread_is_on_its_way_off_the_cpu(tmp_path: Path) -> None:
    """The freezer counts a task frozen a moment before it leaves the CPU: a read taken
    while a thread is still runnable may miss its last context switch."""
    _thread_states(tmp_path, {7: "S", 8: "R"})
    reads: list[int] = []

    def read() -> Snapshot:
        reads.append(len(reads))
        if len(reads) == 3:  # the runnable thread leaves the CPU
            _thread_states(tmp_path, {7: "S", 8: "D"})
        return snap(procs=(replace(AGENT, activity=(3, 1, 2, 2 + len(reads), 0)),))

    got = snapshot.frozen(read, proc_root=tmp_path)
    assert snapshot.runnable_threads([7], tmp_path) == []
    assert got.processes[7].activity[3] == 2 + len(reads) and len(reads) >= 4


def test_a_frozen_read_gives_up_waiting_with_the_last_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _thread_states(tmp_path, {7: "R"})
    monkeypatch.setattr(snapshot, "FROZEN_WAIT_SECONDS", 0.02)
    got = snapshot.frozen(lambda: snap(), proc_root=tmp_path)
    assert got.processes[7] == AGENT  # the next turn may then be full, never skip


def test_tree_signature_sees_a_write(tmp_path: Any) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("a")
    before = snapshot.tree_signature(tmp_path)
    assert set(before) == {"d", "d/f"}
    (tmp_path / "d" / "f").write_text("bb")
    assert snapshot.tree_signature(tmp_path)["d/f"] != before["d/f"]


# -- request validation ----------------------------------------------------------------------

def test_parse_path() -> None:
    assert turns.parse_path("/v1/namespaces/agents/agentsandboxes/box-1/turns") == (
        "agents", "box-1")
    for bad in ("/v1/namespaces/agents/agentsandboxes/box-1", "/metrics",
                "/v1/namespaces/Agents/agentsandboxes/box/turns",
                "/v1/namespaces/a/agentsandboxes/../turns"):
        with pytest.raises(turns.Refused) as err:
            turns.parse_path(bad)
        assert err.value.status == 404


def test_parse_bearer_and_body() -> None:
    assert turns.parse_bearer("Bearer abc ") == "abc"
    for bad in (None, "", "Basic abc", "Bearer "):
        with pytest.raises(turns.Refused) as err:
            turns.parse_bearer(bad)
        assert err.value.status == 401
    assert turns.parse_body(b'{"turn": 3}') == (3, 0.0)
    assert turns.parse_body(b'{"turn": 0, "waitSeconds": 30}') == (0, 30.0)
    for bad in (b"", b"[]", b"nope", b'{"turn": -1}', b'{"turn": "3"}', b'{"turn": true}',
                b'{"turn": 1, "waitSeconds": 9999}'):
        with pytest.raises(turns.Refused) as err:
            turns.parse_body(bad)
        assert err.value.status == 400


def test_turn_status_fits_the_crd() -> None:
    decision = inspector.Decision(protocol.TURN_FILES_ONLY, ("workspace: 1 added (a)",))
    status = turns.turn_status(4, decision)
    assert status["turn"] == {"number": 4, "decision": "files-only",
                              "reasons": ["workspace: 1 added (a)"], "taken": "full",
                              "coveredThrough": 4}
    obj = ckpt("box-1-turn4", reason=protocol.TURN, status={"phase": "Pending", **status})
    assert schema_errors(obj) == []


# -- the service against a fake API -----------------------------------------------------------


def test_turns_checkpoint_only_what_changed() -> None:
    kube = FakeKube()
    changed = snap(files={"rootfs": {}, "workspace": {"new": SIG}},
                   procs=tuple(THAWED.processes.values()))
    svc = service(kube, [snap(), THAWED, changed, changed])
    first = post(svc, 1)
    assert (first.status, first.body["decision"], first.body["checkpoint"]) == (
        201, "full", "box-1-turn1")
    made = kube.checkpoints["box-1-turn1"]
    assert made["spec"]["reason"] == protocol.TURN
    assert made["metadata"]["labels"][protocol.LABEL_NODE] == NODE
    assert made["metadata"]["labels"][protocol.LABEL_INCARNATION] == "1"
    assert made["status"]["turn"]["decision"] == "full"
    kube.complete("box-1-turn1")
    second = post(svc, 2)
    assert (second.status, second.body["decision"], second.body["checkpoint"]) == (
        200, "skip", "box-1-turn1")
    assert set(kube.checkpoints) == {"box-1-turn1"}, "a skipped turn makes no checkpoint"
    assert kube.checkpoints["box-1-turn1"]["status"]["turn"]["coveredThrough"] == 2
    third = post(svc, 3)
    assert (third.body["decision"], third.body["taken"]) == ("files-only", "full")
    assert kube.checkpoints["box-1-turn3"]["status"]["turn"]["decision"] == "files-only"
    # Turn 3's checkpoint is not Completed yet: turn 4 compares with turn 1's, so it
    # checkpoints again rather than trust a checkpoint that may still fail.
    assert post(svc, 4).body["decision"] == "files-only"
    assert kube.reviews[0] == {"namespace": "agents", "verb": "create", "group": "hermit.dev",
                               "resource": "agentsandboxes", "subresource": "turns",
                               "name": "box"}


def test_a_repeated_turn_gets_the_first_answer_and_an_older_one_is_refused() -> None:
    kube = FakeKube()
    svc = service(kube, [snap(), snap()])
    first = post(svc, 5)
    again = post(svc, 5)
    assert again.body == {**first.body, "repeated": True}
    assert len(kube.checkpoints) == 1
    older = post(svc, 4)
    assert older.status == 409 and "older than turn 5" in older.body["error"]


def test_a_failed_turn_checkpoint_is_not_a_baseline() -> None:
    kube = FakeKube()
    svc = service(kube, [snap(), snap()])
    post(svc, 1)
    kube.checkpoints["box-1-turn1"]["status"]["phase"] = protocol.FAILED
    assert post(svc, 2).body["decision"] == "full"


def test_a_deleted_baseline_means_full() -> None:
    kube = FakeKube()
    svc = service(kube, [snap(), THAWED, THAWED])
    post(svc, 1)
    kube.complete("box-1-turn1")
    assert post(svc, 2).body["decision"] == "skip"
    del kube.checkpoints["box-1-turn1"]
    reply = post(svc, 3)
    assert reply.body["decision"] == "full"
    assert "box-1-turn1 is gone" in reply.body["reasons"][0]


def test_wait_seconds_reports_the_phase() -> None:
    kube = FakeKube()
    svc = service(kube, [snap()])
    real = kube.get_checkpoint
    calls = []

    def completes_on_second_read(namespace: str, name: str) -> dict[str, Any] | None:
        calls.append(name)
        if len(calls) == 2:
            kube.complete(name)
        return real(namespace, name)

    kube.get_checkpoint = completes_on_second_read  # type: ignore[method-assign]
    assert post(svc, 1, waitSeconds=10).body["phase"] == protocol.COMPLETED


@pytest.mark.parametrize("change, status, words", [
    (lambda k: setattr(k, "authenticated", False), 401, "not valid"),
    (lambda k: setattr(k, "allowed", False), 403, "may not create agentsandboxes/turns"),
    (lambda k: setattr(k, "sandbox", None), 404, "does not exist"),
    (lambda k: k.sandbox["spec"].update(checkpoint={}), 409, "onTurn false"),
    (lambda k: (setattr(k, "pods", []), k.sandbox["status"].update(nodeName="node-b")), 421,
     "runs on node node-b"),
    (lambda k: setattr(k, "pods", []), 409, "not running"),
])
def test_refusals(change: Any, status: int, words: str) -> None:
    kube = FakeKube()
    change(kube)
    reply = post(service(kube, [snap()]), 1)
    assert reply.status == status and words in reply.body["error"], reply
    assert kube.checkpoints == {}
    if status == 421:
        assert reply.body["node"] == "node-b"


def test_no_token_and_bad_paths_are_refused_before_any_api_call() -> None:
    kube = FakeKube()
    svc = service(kube, [])
    assert svc.handle(PATH, None, b'{"turn": 1}').status == 401
    assert post(svc, 1, path="/v1/namespaces/agents/pods/x/turns").status == 404
    assert svc.handle(PATH, "Bearer good", b"{}").status == 400
    assert kube.reviews == [] and kube.audiences == []


def test_the_audience_goes_to_the_token_review() -> None:
    kube = FakeKube()
    post(service(kube, [snap()], audience="hermit-turns"), 1)
    assert kube.audiences == [["hermit-turns"]]


def test_an_authenticator_that_ignores_the_audience_is_not_trusted() -> None:
    kube = FakeKube()
    kube.audience_aware = False  # authenticated, but status.audiences does not name ours
    reply = post(service(kube, [snap()], audience="hermit-turns"), 1)
    assert reply.status == 401 and "for audience hermit-turns" in reply.body["error"]
    kube_api = FakeKube()
    kube_api.audience_aware = False  # the explicit opt-out: the API server's audiences
    assert post(service(kube_api, [snap()], audience=""), 1).status == 201


def test_the_baseline_takes_the_counters_after_the_thaw() -> None:
    kube = FakeKube()
    svc = service(kube, [snap(), snap()])
    post(svc, 1)
    kube.complete("box-1-turn1")
    # The turn's end state again: the agent's switches differ from the ones after the thaw.
    reply = post(svc, 2)
    assert reply.body["decision"] == "full" and "processes ran: pids 7" in reply.body["reasons"]


def test_a_turn_waits_briefly_for_the_counters_of_the_previous_checkpoint() -> None:
    """The read after the thaw runs in a thread; a turn that ends before it recorded
    waits for it (up to SETTLE_WAIT_SECONDS) rather than deciding full without them."""
    kube = FakeKube()
    spawned: list[Any] = []
    svc = service(kube, [snap(), snap()], spawn=spawned.append)
    post(svc, 1)
    kube.complete("box-1-turn1")
    late = threading.Timer(0.3, spawned[0])  # the settle thread, late on a busy node
    late.start()
    reply = post(svc, 2)
    late.join()
    assert not any("were not read" in r for r in reply.body["reasons"]), reply.body


def test_a_checkpoint_whose_thaw_was_not_read_is_no_baseline() -> None:
    kube = FakeKube()
    svc = service(kube, [snap(), snap()], thawed=None)
    post(svc, 1)
    kube.complete("box-1-turn1")
    reply = post(svc, 2)
    assert reply.body["decision"] == "full"
    assert "after turn checkpoint box-1-turn1 were not read" in reply.body["reasons"][0]


def test_settled_keeps_the_turns_files_and_processes_and_the_thawed_counters() -> None:
    extra = Proc(9, 70, "/bin/sh", ("sh",), (1,) * 7, (0, 0, 1, 1, 0))
    dumped = snap(procs=(replace(AGENT, activity=(4, 1, 1, 19, 0)),))
    after = snap(files={"rootfs": {}}, procs=(replace(AGENT, activity=(4, 1, 1, 20, 0)), extra))
    base = inspector.settled(snap(), dumped, after)
    assert base.files == snap().files and set(base.processes) == {1, 7}
    assert base.processes[7].activity == (4, 1, 1, 20, 0)  # only the thaw's wake-up moved
    assert base.processes[1] == INIT  # not there at the dump: kept as the turn saw it


def test_settled_keeps_the_counters_at_the_dump_of_a_process_that_ran_after_it() -> None:
    dumped = snap(procs=(INIT, replace(AGENT, activity=(3, 1, 1, 8, 0))))
    ran = snap(procs=(INIT, replace(AGENT, memory=(2000, 600, 200, 400, 0, 300, 0),
                                    activity=(5, 1, 1, 30, 0))))
    base = inspector.settled(snap(), dumped, ran)
    assert base.processes[7].activity == (3, 1, 1, 8, 0)
    assert base.processes[7].memory == AGENT.memory
    # However late the read after the thaw was, the next turn sees the process ran.
    assert inspector.decide(base, ran).decision == "full"


@pytest.mark.parametrize(("after", "only"), [
    (replace(AGENT, activity=(3, 1, 1, 2, 0)), True),  # nothing moved
    (replace(AGENT, activity=(3, 1, 1, 3, 0)), True),  # its one thread woke and slept again
    (replace(AGENT, activity=(3, 1, 1, 3, 1)), True),  # ... preempted on the way
    (replace(AGENT, activity=(3, 1, 1, 4, 0)), False),  # and slept once more: it ran
    (replace(AGENT, activity=(3, 1, 1, 2, 2)), False),  # preempted more than once
    (replace(AGENT, activity=(4, 1, 1, 3, 0)), False),  # a clock tick of user time
    (replace(AGENT, activity=(3, 2, 1, 3, 0)), False),  # of system time
    (replace(AGENT, activity=(3, 1, 2, 3, 0)), False),  # a thread started
    (replace(AGENT, activity=(3, 1, 1, 1, 0)), False),  # fewer: not the same process
    (replace(AGENT, memory=(2000, 504, 104, 400, 0, 300, 0)), False),  # memory moved
    (replace(AGENT, start_ticks=61), False),  # another process under the same pid
])
def test_thaw_only_allows_one_wake_up_per_thread_and_nothing_else(after: Proc,
                                                                  only: bool) -> None:
    assert inspector.thaw_only(AGENT, after) is only


def test_thaw_only_ignores_the_activity_of_hermits_init_but_not_its_memory() -> None:
    assert inspector.thaw_only(INIT, replace(INIT, activity=(5, 5, 1, 99, 0)))
    assert not inspector.thaw_only(INIT, replace(INIT, memory=(801, 4, 0, 0, 0, 4, 0)))


def test_a_process_that_ran_between_the_dump_and_a_late_thaw_read_makes_the_next_turn_full(
) -> None:
    """The read after the thaw waits for the Uploading status and for the counters to
    hold still, so on a busy node it lands late; a workload that ran meanwhile, and not
    since, changed its memory after the dump: the next turn must be full, not files-only
    (that restored older memory with newer files)."""
    kube = FakeKube()
    ran = (replace(AGENT, activity=(9, 2, 1, 40, 0)),)
    late = snap(procs=(INIT, *ran))
    turn2 = snap(files={"rootfs": {"etc/x": replace(SIG, size=11)},
                        "workspace": {"a.txt": SIG}}, procs=(INIT, *ran))
    svc = service(kube, [snap(), turn2], thawed=late)
    post(svc, 1)
    kube.complete("box-1-turn1")
    reply = post(svc, 2)
    assert reply.body["decision"] == "full", reply.body
    assert "processes ran: pids 7" in reply.body["reasons"]


def test_a_checkpoint_whose_processes_were_not_read_at_the_dump_is_no_baseline() -> None:
    kube = FakeKube()
    svc = service(kube, [snap(), THAWED], dumped=None)
    post(svc, 1)
    kube.complete("box-1-turn1")
    reply = post(svc, 2)
    assert reply.body["decision"] == "full"
    assert "after turn checkpoint box-1-turn1 were not read" in reply.body["reasons"][0]


def test_only_turn_checkpoints_are_read_at_the_dump() -> None:
    reads: list[str] = []
    svc = turns.TurnService(NODE, FakeKube(), lambda sp: snap(), lambda sp: None,
                            at_dump=lambda sp: reads.append(sp.pod) or snap())
    sp = planner.sandbox_pods([pod()], NODE)[0]
    svc.captured(sp, "box-1-manual", protocol.MANUAL)
    assert reads == []
    svc.captured(sp, "box-1-turn1", protocol.TURN)
    assert reads == [sp.pod]


def test_the_http_server_answers_with_the_services_reply() -> None:
    import requests

    from hermit_node.turns import turnserver

    kube = FakeKube()
    server = turnserver.serve(0, service(kube, [snap()]), host="127.0.0.1")
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}{PATH}"
        ok = requests.post(url, json={"turn": 1}, headers={"Authorization": "Bearer good"},
                           timeout=10)
        assert ok.status_code == 201 and ok.json()["checkpoint"] == "box-1-turn1"
        assert requests.post(url, json={"turn": 2}, timeout=10).status_code == 401
        assert requests.get(url, timeout=10).status_code == 405
        big = requests.post(url, data=b"x" * 5000, timeout=10,
                            headers={"Authorization": "Bearer good"})
        assert big.status_code == 413
    finally:
        server.shutdown()


def test_an_unreadable_container_is_a_500_not_a_crash() -> None:
    def broken(sp: SandboxPod) -> Snapshot:
        raise FileNotFoundError(2, "No such file or directory")

    svc = turns.TurnService(NODE, FakeKube(), broken, lambda sp: None)
    reply = post(svc, 1)
    assert reply.status == 500 and "No such file" in reply.body["error"]


def test_a_checkpoint_that_failed_before_the_thaw_leaves_no_baseline() -> None:
    kube = FakeKube()
    kube.served_to = protocol.FAILED
    svc = service(kube, [snap(), THAWED])
    post(svc, 1)
    assert post(svc, 2).body["decision"] == "full"


def test_settled_takes_the_directories_after_the_thaw_not_the_files() -> None:
    tmp = FileSig(0o40755, 0, 5, 5, 300, 0, 0)
    turn_end = snap(files={"rootfs": {"etc/x": SIG}})
    thawed = snap(files={"rootfs": {"etc/x": replace(SIG, size=99), "tmp": tmp}})
    base = inspector.settled(turn_end, turn_end, thawed)
    # CRIU's temporary directory copied /tmp up: no change at the next turn; a file
    # written after the turn's end still is one.
    assert base.files["rootfs"] == {"etc/x": SIG, "tmp": tmp}
    assert inspector.decide(base, replace(turn_end, files=base.files)).decision == "skip"
    assert inspector.decide(base, thawed).decision == "files-only"
