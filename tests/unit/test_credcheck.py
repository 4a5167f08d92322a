"""credcheck: a restored process holds no more than the new container's init.

Every field CRIU restores that grants privilege, each compared with a container that
does not grant it (refused, naming pid, field, what the image asks and what the pod
grants) and with one that does (restores); the /proc parsers; the images' dicts as
pycriu decodes them; the size bounds, checked before anything parses.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from pathlib import Path
from typing import Any

import pytest

from hermit_common.errors import CheckpointRefused, RestoreFailed
from hermit_common.pin import Pin
from hermit_node.host import credcheck, criu, pagemap, protowire
from hermit_node.host.credcheck import (
    CAP_SETGID,
    CAP_SETPCAP,
    CAP_SETUID,
    CAP_SYS_NICE,
    CAP_SYS_RESOURCE,
    RLIM_INFINITY,
    SECCOMP_DISABLED,
    SECCOMP_FILTER,
    SECCOMP_STRICT,
    Granted,
    ImageCreds,
    ThreadCreds,
)
from tests.support.pagemap import varint

# The default runc/containerd capability set (14 capabilities).
DEFAULT_CAPS = 0x00000000A80425FB
ALL_CAPS = (1 << 41) - 1
CAP_NET_RAW = 13
CAP_SYS_ADMIN = 21
LIMITS = (RLIM_INFINITY,) * 6 + (4096, 1024, 65536) + (RLIM_INFINITY,) * 2 + (
    4096, 819200, 0, 0, RLIM_INFINITY)


def bit(*caps: int) -> int:
    return sum(1 << c for c in caps)


def pod(**changes: object) -> Granted:
    """A container running as root with the default capabilities, no_new_privs and the
    runtime's default seccomp profile (one filter)."""
    base = Granted(uids=(0, 0, 0, 0), gids=(0, 0, 0, 0), groups=frozenset(),
                   cap_inh=0, cap_prm=DEFAULT_CAPS, cap_eff=DEFAULT_CAPS,
                   cap_bnd=DEFAULT_CAPS, cap_amb=0, no_new_privs=True,
                   seccomp_mode=SECCOMP_FILTER, seccomp_filters=1, rlimits_max=LIMITS)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def nonroot_pod(**changes: object) -> Granted:
    """runAsUser 1000, runAsGroup 1000, fsGroup 2000: no capabilities left in effect."""
    return pod(**{"uids": (1000,) * 4, "gids": (1000,) * 4, "groups": frozenset({1000, 2000}),
                  "cap_prm": 0, "cap_eff": 0, **changes})


def proc(**changes: object) -> ThreadCreds:
    """A process that kept within ``pod()``."""
    base = ThreadCreds(pid=7, tid=7, uids=(0, 0, 0, 0), gids=(0, 0, 0, 0),
                       cap_prm=DEFAULT_CAPS, cap_eff=DEFAULT_CAPS, cap_bnd=DEFAULT_CAPS,
                       no_new_privs=True, seccomp_mode=SECCOMP_FILTER, seccomp_filters=1,
                       rlimits_max=LIMITS)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def nonroot_proc(**changes: object) -> ThreadCreds:
    return proc(**{"uids": (1000,) * 4, "gids": (1000,) * 4, "groups": (1000, 2000),
                   "cap_prm": 0, "cap_eff": 0, **changes})


def fields(thread: ThreadCreds, granted: Granted) -> list[str]:
    return [v.field for v in credcheck.violations(ImageCreds((thread,)), granted)]


def test_a_process_that_kept_within_the_pod_restores() -> None:
    assert fields(proc(), pod()) == []
    assert fields(nonroot_proc(), nonroot_pod()) == []
    # Dropping privilege is always fine.
    assert fields(proc(cap_prm=0, cap_eff=0, cap_bnd=bit(CAP_NET_RAW), seccomp_filters=3,
                       rlimits_max=(0,) * 16), pod()) == []


def test_the_forged_full_capability_root_process_is_refused_on_every_set() -> None:
    forged = proc(cap_inh=ALL_CAPS, cap_prm=ALL_CAPS, cap_eff=ALL_CAPS, cap_bnd=ALL_CAPS,
                  cap_amb=ALL_CAPS)
    found = credcheck.violations(ImageCreds((forged,)), pod())
    assert [v.field for v in found] == ["cap_bnd", "cap_prm", "cap_eff", "cap_amb", "cap_inh"]
    assert "CAP_SYS_ADMIN" in found[0].asked and "CAP_SYS_ADMIN" not in found[0].granted
    assert "CAP_CHOWN" not in found[0].asked  # only what is beyond the pod is named


@pytest.mark.parametrize("name", ["cap_bnd", "cap_prm", "cap_eff", "cap_amb", "cap_inh"])
def test_one_capability_beyond_the_pod_in_any_set_is_refused(name: str) -> None:
    granted = pod(cap_prm=DEFAULT_CAPS & ~bit(CAP_NET_RAW),
                  cap_eff=DEFAULT_CAPS & ~bit(CAP_NET_RAW),
                  cap_bnd=DEFAULT_CAPS & ~bit(CAP_NET_RAW))
    base = proc(cap_prm=granted.cap_prm, cap_eff=granted.cap_eff, cap_bnd=granted.cap_bnd)
    assert fields(base, granted) == []
    found = credcheck.violations(
        ImageCreds((dataclasses.replace(base, **{name: getattr(base, name)
                                                 | bit(CAP_NET_RAW)}),)), granted)
    assert [v.field for v in found] == [name]
    assert found[0].asked.startswith("asks CAP_NET_RAW beyond")


def test_effective_capabilities_of_a_nonroot_pod_are_refused() -> None:
    # runAsUser 1000 keeps the bounding set but nothing permitted: CAP_NET_RAW in effect
    # (as after executing a file-capability ping) is not what the pod grants.
    assert fields(nonroot_proc(cap_prm=bit(CAP_NET_RAW), cap_eff=bit(CAP_NET_RAW)),
                  nonroot_pod()) == ["cap_prm", "cap_eff"]


def test_inheritable_follows_capset() -> None:
    # Without CAP_SETPCAP: within the init's inheritable and permitted sets.
    granted = pod(cap_prm=bit(CAP_NET_RAW), cap_eff=bit(CAP_NET_RAW))
    assert fields(proc(cap_prm=bit(CAP_NET_RAW), cap_eff=0, cap_inh=bit(CAP_NET_RAW)),
                  granted) == []
    assert fields(proc(cap_prm=0, cap_eff=0, cap_inh=bit(CAP_SYS_ADMIN)), granted) == \
        ["cap_inh"]
    # With CAP_SETPCAP in effect: anything of the bounding set.
    assert fields(proc(cap_inh=bit(CAP_SYS_ADMIN)), pod(cap_bnd=ALL_CAPS)) == []
    assert fields(proc(cap_inh=bit(40)), pod()) == ["cap_inh"]


@pytest.mark.parametrize("index,name", [(0, "uid"), (1, "euid"), (2, "suid"), (3, "fsuid")])
def test_a_uid_the_pod_does_not_run_as_is_refused_without_cap_setuid(index: int,
                                                                     name: str) -> None:
    uids = [1000] * 4
    uids[index] = 0
    found = credcheck.violations(ImageCreds((nonroot_proc(uids=tuple(uids)),)),
                                 nonroot_pod())
    assert [v.field for v in found] == [name]
    assert str(found[0]) == (f"pid 7: {name} asks uid 0; the new pod grants uids [1000] "
                             "and no CAP_SETUID")


def test_uid_changes_within_the_init_ids_or_with_cap_setuid_pass() -> None:
    granted = nonroot_pod(uids=(1000, 1000, 1001, 1000))  # saved uid 1001
    assert fields(nonroot_proc(uids=(1001, 1001, 1000, 1001)), granted) == []
    # Root with CAP_SETUID may become anyone; root without it may not.
    assert fields(proc(uids=(4242,) * 4), pod()) == []
    no_setuid = pod(cap_prm=DEFAULT_CAPS & ~bit(CAP_SETUID))
    assert fields(proc(uids=(4242,) * 4, cap_prm=no_setuid.cap_prm, cap_eff=no_setuid.cap_prm),
                  no_setuid) == ["uid", "euid", "suid", "fsuid"]


@pytest.mark.parametrize("index,name", [(0, "gid"), (1, "egid"), (2, "sgid"), (3, "fsgid")])
def test_a_gid_the_pod_does_not_run_as_is_refused_without_cap_setgid(index: int,
                                                                     name: str) -> None:
    gids = [1000] * 4
    gids[index] = 0
    assert fields(nonroot_proc(gids=tuple(gids)), nonroot_pod()) == [name]


def test_supplementary_groups_beyond_the_pod_need_cap_setgid() -> None:
    assert fields(nonroot_proc(groups=(1000,)), nonroot_pod()) == []
    found = credcheck.violations(ImageCreds((nonroot_proc(groups=(0, 1000)),)), nonroot_pod())
    assert [v.field for v in found] == ["groups"] and "[0]" in found[0].asked
    assert fields(proc(groups=(0, 4, 27)), pod()) == []  # root with CAP_SETGID
    assert CAP_SETGID == 6


def test_securebits_other_than_keep_caps_need_cap_setpcap() -> None:
    no_setpcap = DEFAULT_CAPS & ~bit(CAP_SETPCAP)
    granted = pod(cap_prm=no_setpcap, cap_eff=no_setpcap)
    base = proc(cap_prm=no_setpcap, cap_eff=no_setpcap)
    assert fields(dataclasses.replace(base, secbits=0x10), granted) == []  # KEEP_CAPS
    assert fields(dataclasses.replace(base, secbits=0x4), granted) == ["secbits"]
    assert fields(proc(secbits=0x2F), pod()) == []


def test_no_new_privs_off_when_the_pod_has_it_on_is_refused() -> None:
    assert fields(proc(no_new_privs=False), pod()) == ["no_new_privs"]
    assert fields(proc(no_new_privs=False), pod(no_new_privs=False)) == []
    assert fields(proc(no_new_privs=True), pod(no_new_privs=False)) == []


def test_seccomp_weaker_than_the_pod_is_refused() -> None:
    found = credcheck.violations(
        ImageCreds((proc(seccomp_mode=SECCOMP_DISABLED, seccomp_filters=0),)), pod())
    assert [(v.field, v.asked, v.granted) for v in found] == [
        ("seccomp", "mode disabled", "seccomp mode filter")]
    # Fewer filters than the pod's chain: one was removed.
    assert fields(proc(seccomp_filters=1), pod(seccomp_filters=2)) == ["seccomp"]
    assert fields(proc(seccomp_mode=SECCOMP_FILTER, seccomp_filters=0), pod()) == ["seccomp"]
    # Stronger or as strong passes; a mode CRIU does not know is refused.
    assert fields(proc(seccomp_mode=SECCOMP_STRICT, seccomp_filters=0), pod()) == []
    assert fields(proc(seccomp_filters=2), pod()) == []
    assert fields(proc(seccomp_mode=SECCOMP_DISABLED, seccomp_filters=0),
                  pod(seccomp_mode=SECCOMP_DISABLED, seccomp_filters=0)) == []
    assert fields(proc(seccomp_mode=SECCOMP_FILTER, seccomp_filters=1),
                  pod(seccomp_mode=SECCOMP_STRICT)) == ["seccomp"]
    assert fields(proc(seccomp_mode=9), pod()) == ["seccomp"]


def test_the_lsm_label_of_a_confined_pod_is_kept() -> None:
    confined = pod(lsm_label="cri-containerd.apparmor.d")
    assert fields(proc(lsm_profile="cri-containerd.apparmor.d"), confined) == []
    assert fields(proc(), confined) == ["lsm_profile"]  # CRIU would leave it unconfined
    assert fields(proc(lsm_profile="unconfined"), confined) == ["lsm_profile"]
    assert fields(proc(lsm_profile="other"), pod()) == []  # unconfined pod: any is stricter
    assert fields(proc(lsm_sockcreate="system_u:system_r:spc_t:s0"), pod()) == \
        ["lsm_sockcreate"]
    assert fields(proc(apparmor_data=True), pod()) == ["apparmor_data"]


def test_rlimits_above_the_pods_hard_limits_need_cap_sys_resource() -> None:
    raised = list(LIMITS)
    raised[7] = 1 << 20  # RLIMIT_NOFILE
    raised[8] = RLIM_INFINITY  # RLIMIT_MEMLOCK
    found = credcheck.violations(ImageCreds((proc(rlimits_max=tuple(raised)),)), pod())
    assert [(v.field, v.asked, v.granted) for v in found] == [
        ("RLIMIT_NOFILE", "asks hard limit 1048576", "1024"),
        ("RLIMIT_MEMLOCK", "asks hard limit unlimited", "65536")]
    assert fields(proc(rlimits_max=None), pod()) == ["rlimits"]
    resource = pod(cap_prm=DEFAULT_CAPS | bit(CAP_SYS_RESOURCE))
    assert fields(proc(rlimits_max=tuple(raised)), resource) == []


def test_scheduling_beyond_the_pod_needs_cap_sys_nice() -> None:
    assert fields(proc(sched_policy=1, sched_prio=50), pod()) == ["sched_prio"]
    assert fields(proc(sched_policy=2, sched_prio=1), pod()) == ["sched_prio"]
    assert fields(proc(sched_policy=6), pod()) == ["sched_policy"]
    assert fields(proc(sched_nice=-5), pod()) == ["sched_nice"]
    assert fields(proc(sched_nice=5, sched_policy=3), pod()) == []  # SCHED_BATCH, nicer
    assert fields(proc(sched_nice=-5), pod(nice=-5)) == []  # as the init
    rt = list(LIMITS)
    rt[13], rt[14] = 25, 10  # RLIMIT_NICE allows nice -5, RLIMIT_RTPRIO 10
    assert fields(proc(sched_nice=-5, sched_policy=1, sched_prio=10, rlimits_max=tuple(rt)),
                  pod(rlimits_max=tuple(rt))) == []
    nice = pod(cap_prm=DEFAULT_CAPS | bit(CAP_SYS_NICE))
    assert fields(proc(sched_policy=1, sched_prio=99, sched_nice=-20), nice) == []


def test_missing_creds_user_namespaces_and_policy_loads_are_refused() -> None:
    found = credcheck.violations(ImageCreds((ThreadCreds(3, 4, None),), user_namespaces=(3,),
                                            apparmor_policies=True,
                                            problems=("pid 9 has no core-9.img",)), pod())
    assert [v.field for v in found] == ["images", "user namespace", "apparmor.img", "creds"]
    assert str(found[-1]).startswith("pid 3 thread 4: creds are missing")


def test_check_raises_one_message_naming_pid_field_image_and_pod() -> None:
    forged = proc(pid=12, tid=12, uids=(0,) * 4, cap_bnd=ALL_CAPS, cap_eff=ALL_CAPS,
                  cap_prm=ALL_CAPS, no_new_privs=False, seccomp_mode=0, seccomp_filters=0)
    with pytest.raises(CheckpointRefused) as info:
        credcheck.check(ImageCreds((forged, dataclasses.replace(forged, tid=13))),
                        nonroot_pod(), "checkpoint agents/c1")
    message = str(info.value)
    assert message.startswith("checkpoint agents/c1 is refused: its processes would hold "
                              "more than the new pod grants: pid 12, pid 12 thread 13: uid asks "
                              "uid 0; the new pod grants uids [1000] and no CAP_SETUID")
    # Each violation once, with every thread it applies to.
    assert message.count(": uid asks") == 1 and "pid 12 thread 13: egid asks gid 0" in message
    assert "\n" not in message and message.endswith("; and 7 more")
    credcheck.check(ImageCreds((proc(),)), pod(), "checkpoint agents/c1")


# -- /proc parsers ---------------------------------------------------------------------------

STATUS = """Name:\thermit-init
Umask:\t0022
State:\tS (sleeping)
Uid:\t1000\t1000\t1000\t1000
Gid:\t1000\t1000\t1000\t1000
Groups:\t1000 2000
NoNewPrivs:\t1
Seccomp:\t2
Seccomp_filters:\t1
CapInh:\t0000000000000000
CapPrm:\t0000000000000000
CapEff:\t0000000000000000
CapBnd:\t00000000a80425fb
CapAmb:\t0000000000000000
"""

LIMITS_TEXT = """Limit                     Soft Limit           Hard Limit           Units
Max cpu time              unlimited            unlimited            seconds
Max file size             unlimited            unlimited            bytes
Max data size             unlimited            unlimited            bytes
Max stack size            8388608              unlimited            bytes
Max core file size        0                    unlimited            bytes
Max resident set          unlimited            unlimited            bytes
Max processes             4096                 4096                 processes
Max open files            1024                 1024                 files
Max locked memory         65536                65536                bytes
Max address space         unlimited            unlimited            bytes
Max file locks            unlimited            unlimited            locks
Max pending signals       4096                 4096                 signals
Max msgqueue size         819200               819200               bytes
Max nice priority         0                    0
Max realtime priority     0                    0
Max realtime timeout      unlimited            unlimited            us
"""


def test_granted_from_proc_texts() -> None:
    stat = "42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0 0 0 0 0 20 -3 1 0 1 2 3"
    granted = credcheck.granted_from(STATUS, LIMITS_TEXT, stat,
                                     "cri-containerd.apparmor.d (enforce)\n", None)
    assert granted == nonroot_pod(nice=-3, lsm_label="cri-containerd.apparmor.d")


def test_lsm_labels() -> None:
    assert credcheck.parse_lsm_label("unconfined\n") is None
    assert credcheck.parse_lsm_label(None) is None
    assert credcheck.parse_lsm_label("system_u:system_r:container_t:s0:c1,c2\x00") == \
        "system_u:system_r:container_t:s0:c1,c2"


def test_read_granted_of_this_process_and_of_a_gone_one() -> None:
    granted = credcheck.read_granted(os.getpid())
    assert granted.uids[0] == os.getuid() and len(granted.rlimits_max) == 16
    with pytest.raises(RestoreFailed):  # the container's state, not the checkpoint's
        credcheck.read_granted(2**22 + 7)


# -- the images' dicts, as pycriu decodes them ---------------------------------------------

def core(**thread: object) -> dict[str, Any]:
    creds = {"uid": 1000, "gid": 1000, "euid": 1000, "egid": 1000, "suid": 1000,
             "sgid": 1000, "fsuid": 1000, "fsgid": 1000, "cap_inh": [0, 0],
             "cap_prm": [0, 0], "cap_eff": [0, 0], "cap_bnd": [DEFAULT_CAPS, 0],
             "secbits": 0, "groups": [1000, 2000], "no_new_privs": 1, "cap_amb": [0, 0]}
    tc = {"task_state": 1, "rlimits": {"rlimits": [{"cur": 0, "max": m} for m in LIMITS]}}
    return {"tc": tc, "thread_core": {"creds": creds, "seccomp_mode": "filter",
                                      "seccomp_filter": 1, "sched_policy": 0,
                                      "sched_nice": 0, **thread}}


FILTERS: list[dict[str, Any]] = [{"filter": "AA=="}, {"filter": "AA==", "prev": 0}]


def test_thread_creds_from_a_core_image() -> None:
    thread = credcheck.thread_creds(7, 7, core(), FILTERS)
    assert thread == nonroot_proc(seccomp_filters=2)
    assert credcheck.violations(ImageCreds((thread,)), nonroot_pod()) == []
    forged = core()
    forged["thread_core"]["creds"].update(
        {"cap_bnd": [0xFFFFFFFF, 0x1FF], "cap_eff": [0xFFFFFFFF, 0x1FF], "uid": 0})
    thread = credcheck.thread_creds(7, 7, forged, FILTERS)
    assert thread.cap_bnd == (1 << 41) - 1 and thread.uids == (0, 1000, 1000, 1000)
    # No thread_core, or no creds in it: CRIU would keep its own (host root's).
    assert credcheck.thread_creds(7, 7, {"tc": {}}, []).uids is None
    assert credcheck.thread_creds(7, 7, core(creds=None), []).uids is None


def test_seccomp_fields_of_old_images_and_chains() -> None:
    old = core()
    del old["thread_core"]["seccomp_mode"]
    del old["thread_core"]["seccomp_filter"]
    old["tc"].update({"old_seccomp_mode": 2, "old_seccomp_filter": 0})
    assert credcheck.thread_creds(7, 7, old, FILTERS).seccomp_filters == 1
    disabled = credcheck.thread_creds(7, 7, core(seccomp_mode="disabled"), FILTERS)
    assert (disabled.seccomp_mode, disabled.seccomp_filters) == (SECCOMP_DISABLED, 0)
    assert credcheck.chain_length(FILTERS, 5) == 0  # out of range: CRIU refuses it too
    cycle: list[dict[str, Any]] = [{"prev": 1}, {"prev": 0}]
    assert credcheck.chain_length(cycle, 0) == 2  # a cycle ends


def test_threads_dumped_without_seccomp_take_their_leaders_tsync_chain() -> None:
    # CRIU dumps threads that share the leader's chain as disabled and restores the
    # leader's chain with TSYNC, which puts it on every thread.
    tsync: list[dict[str, Any]] = [{"filter": "AA==", "flags": 1}]
    assert credcheck.chain_syncs(tsync, 0) and not credcheck.chain_syncs(FILTERS, 1)
    leader = credcheck.thread_creds(7, 7, core(seccomp_filter=0), tsync)
    follower = credcheck.thread_creds(7, 8, core(seccomp_mode="disabled"), tsync)
    synced = credcheck.with_leader_seccomp(follower, leader, True)
    assert (synced.seccomp_mode, synced.seccomp_filters) == (SECCOMP_FILTER, 1)
    assert fields(synced, nonroot_pod()) == []
    # Without TSYNC the thread stays unconfined, and is refused.
    alone = credcheck.with_leader_seccomp(follower, leader, False)
    assert fields(alone, nonroot_pod()) == ["seccomp"]


def test_rlimits_missing_from_a_core_image_are_none() -> None:
    image = core()
    del image["tc"]["rlimits"]
    assert credcheck.thread_creds(7, 7, image, FILTERS).rlimits_max is None


# -- size bounds, checked before anything parses ------------------------------------------

def _sparse(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def test_an_oversize_image_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    big = _sparse(tmp_path / "core-1.img", credcheck.MAX_CORE_IMAGE_BYTES + 1)
    with pytest.raises(CheckpointRefused, match=r"core-1\.img is 1048577 bytes, more than "
                                                r"the 1048576 a restore parses"):
        criu.load_image(big, credcheck.MAX_CORE_IMAGE_BYTES)
    _sparse(tmp_path / "pstree.img", credcheck.MAX_PSTREE_IMAGE_BYTES + 1)
    with pytest.raises(CheckpointRefused, match=r"pstree\.img is"):
        credcheck.read_images(tmp_path)


def test_only_regular_files_are_read(tmp_path: Path) -> None:
    (tmp_path / "core-1.img").symlink_to("/etc/shadow")
    with pytest.raises(CheckpointRefused, match="cannot be opened"):
        criu.read_image_bytes(tmp_path / "core-1.img", 100)
    os.mkfifo(tmp_path / "core-2.img")
    with pytest.raises(CheckpointRefused, match="not a regular file"):
        criu.read_image_bytes(tmp_path / "core-2.img", 100)
    assert criu.read_image_bytes(_sparse(tmp_path / "core-3.img", 100), 100) == bytes(100)


def test_a_checkpoint_without_a_process_tree_is_refused(tmp_path: Path) -> None:
    assert credcheck.read_images(tmp_path).problems == ("there is no pstree.img",)


def _pagemap(*entries: tuple[int, int, int]) -> bytes:
    def msg(*fs: tuple[int, int]) -> bytes:
        body = b"".join(varint(num << 3) + varint(v) for num, v in fs)
        return struct.pack("<I", len(body)) + body

    head = struct.pack("<II", protowire.IMG_COMMON_MAGIC, pagemap.PAGEMAP_MAGIC) + msg((1, 3))
    return head + b"".join(msg((1, v), (4, f), (5, n)) for v, n, f in entries)


def test_read_pagemaps_is_bounded_and_lean(tmp_path: Path) -> None:
    (tmp_path / "pagemap-7.img").write_bytes(_pagemap((0x1000, 2, 4), (0x9000, 1, 6)))
    [pm] = criu.read_pagemaps(tmp_path)
    assert (pm.pid, pm.pages_id, pm.entries) == (7, 3, ((0x1000, 2, 4), (0x9000, 1, 6)))
    _sparse(tmp_path / "pagemap-8.img", pagemap.MAX_PAGEMAP_BYTES + 1)
    with pytest.raises(CheckpointRefused, match=r"pagemap-8\.img is 67108865 bytes"):
        criu.read_pagemaps(tmp_path)
    (tmp_path / "pagemap-8.img").write_bytes(b"\x19\x43\x56\x54junk")
    with pytest.raises(CheckpointRefused, match=r"pagemap-8\.img cannot be parsed"):
        criu.read_pagemaps(tmp_path)


def test_images_of_the_wrong_shape_are_a_refusal(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from hermit_node.engine import restore

    def broken(_: Path) -> ImageCreds:
        thread = credcheck.thread_creds(7, 7, {"thread_core": {"creds": {"uid": "x"}}}, [])
        return ImageCreds((thread,))

    monkeypatch.setattr(credcheck, "read_images", broken)
    target = restore.RestoreTarget(pin=Pin("agents", "s", "c1", uid="u"), init_pid=os.getpid())
    with pytest.raises(CheckpointRefused, match=r"^checkpoint agents/c1 is refused: its CRIU "
                                                r"images are malformed: ValueError"):
        restore.check_images(target, tmp_path)
