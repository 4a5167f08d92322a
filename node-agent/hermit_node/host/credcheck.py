"""Restored processes hold no more privilege than the new container grants.

CRIU restores, as host root, what a checkpoint's images say about each thread: its
uids and gids, supplementary groups, the five capability sets, securebits,
no_new_privs, seccomp mode and filters, LSM label, resource limits and scheduling
policy; and, when the root task's user namespace is not the dumping CRIU's, it
creates a user namespace and writes the id maps the images give. The images come
from the store, which a compromised node writes: a node that forges a checkpoint of
a sandbox it runs and then taints itself would get a fully privileged process on the
next node. So before CRIU runs, every thread the images describe is compared with
what the new container's init holds (``/proc/<pid>/status`` and friends: exactly what
the new pod's securityContext produced), and anything beyond it refuses the
checkpoint.

The rule for each field is what a process of the new container could reach on its
own (the kernel's rules for ``setresuid``, ``capset``, ``prctl``, ``setrlimit``,
``setpriority``): a process that started as the container's init and kept within
them restores; a forged one does not. A process that gained privilege by executing a
setuid or file-capability binary of the image is refused too (deliberately strict:
the images cannot show how a privilege was gained).

Pure functions (``violations``, the parsers) over plain data; ``read_images`` and
``read_granted`` are the thin readers (criu.py decodes the images, size-bounded).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from hermit_common.errors import CheckpointRefused, RestoreFailed
from hermit_node.host import criu

# Capability numbers (linux/capability.h) -> names, for messages.
CAP_NAMES: Final = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID",
    "CAP_KILL", "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE", "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW",
    "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT", "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
    "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN", "CAP_SYSLOG", "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ",
    "CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE",
)
CAP_SETGID: Final = 6
CAP_SETUID: Final = 7
CAP_SETPCAP: Final = 8
CAP_SYS_ADMIN: Final = 21
CAP_SYS_NICE: Final = 23
CAP_SYS_RESOURCE: Final = 24

# Seccomp modes (linux/seccomp.h) and how strong each is: strict allows four syscalls,
# a filter some, disabled all.
SECCOMP_DISABLED: Final = 0
SECCOMP_STRICT: Final = 1
SECCOMP_FILTER: Final = 2
SECCOMP_FILTER_FLAG_TSYNC: Final = 1
_SECCOMP_NAMES: Final = {"disabled": 0, "strict": 1, "filter": 2}
_SECCOMP_STRENGTH: Final = {SECCOMP_DISABLED: 0, SECCOMP_FILTER: 1, SECCOMP_STRICT: 2}

# Securebits (linux/securebits.h) a process may set without CAP_SETPCAP: KEEP_CAPS
# (prctl PR_SET_KEEPCAPS). The others need CAP_SETPCAP; NO_SETUID_FIXUP keeps
# capabilities across a change away from uid 0.
SECBIT_KEEP_CAPS: Final = 1 << 4
# Scheduling policies (linux/sched.h).
SCHED_FIFO: Final = 1
SCHED_RR: Final = 2
SCHED_DEADLINE: Final = 6
RLIMIT_NICE: Final = 13
RLIMIT_RTPRIO: Final = 14
RLIM_INFINITY: Final = (1 << 64) - 1
_RLIMIT_NAMES: Final = ("RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_DATA", "RLIMIT_STACK",
                        "RLIMIT_CORE", "RLIMIT_RSS", "RLIMIT_NPROC", "RLIMIT_NOFILE",
                        "RLIMIT_MEMLOCK", "RLIMIT_AS", "RLIMIT_LOCKS", "RLIMIT_SIGPENDING",
                        "RLIMIT_MSGQUEUE", "RLIMIT_NICE", "RLIMIT_RTPRIO", "RLIMIT_RTTIME")
# CRIU task states whose tasks never run restored code: a zombie is recreated only to
# exit, a helper only holds a session or group id and exits.
TASK_DEAD: Final = 2
TASK_HELPER: Final = 0x80  # COMPEL_TASK_MAX + 1

# Size bounds for the images this module parses (criu.load_image refuses larger ones
# before decoding; pycriu turns each field into Python objects, some 50x the bytes).
# A real core image is 2-8 KiB (registers, FPU state, 64 sigactions, creds); pstree
# about 20 bytes per task and 5 per thread; a seccomp chain is at most 32768 BPF
# instructions of 8 bytes (the kernel's MAX_INSNS_PER_PATH), 256 KiB; the others are
# a few dozen bytes. Each bound is at least 100 times a large real image.
MAX_CORE_IMAGE_BYTES: Final = 1 << 20
MAX_PSTREE_IMAGE_BYTES: Final = 8 << 20
MAX_SECCOMP_IMAGE_BYTES: Final = 16 << 20
MAX_SMALL_IMAGE_BYTES: Final = 1 << 20  # inventory, ids-*, userns-*
# Violations named in the refusal (the rest are counted).
_MAX_SHOWN: Final = 6


@dataclass(frozen=True)
class Granted:
    """What the new container's init holds: the ceiling for every restored thread."""

    uids: tuple[int, int, int, int]  # real, effective, saved, filesystem
    gids: tuple[int, int, int, int]
    groups: frozenset[int]
    cap_inh: int
    cap_prm: int
    cap_eff: int
    cap_bnd: int
    cap_amb: int
    no_new_privs: bool
    seccomp_mode: int
    seccomp_filters: int  # filters in force (Seccomp_filters; 0 when the kernel omits it)
    rlimits_max: tuple[int, ...] = ()  # hard limits by resource number (RLIM_INFINITY)
    nice: int = 0
    lsm_label: str | None = None  # None: unconfined, or no LSM
    lsm_sockcreate: str | None = None

    def has(self, cap: int) -> bool:
        """The init may use ``cap``: it is in its permitted set (it can raise it)."""
        return bool(self.cap_prm >> cap & 1)


@dataclass(frozen=True)
class ThreadCreds:
    """What the images ask CRIU to give one thread (a field CRIU leaves as the restoring
    root's, because the images omit it, is None or False)."""

    pid: int  # the task, as numbered in the images
    tid: int
    uids: tuple[int, int, int, int] | None  # None: no creds (CRIU keeps host root's)
    gids: tuple[int, int, int, int] = (0, 0, 0, 0)
    groups: tuple[int, ...] = ()
    cap_inh: int = 0
    cap_prm: int = 0
    cap_eff: int = 0
    cap_bnd: int = 0
    cap_amb: int = 0
    secbits: int = 0
    no_new_privs: bool = False
    seccomp_mode: int = SECCOMP_DISABLED
    seccomp_filters: int = 0  # length of its filter chain in seccomp.img
    lsm_profile: str | None = None
    lsm_sockcreate: str | None = None
    apparmor_data: bool = False
    rlimits_max: tuple[int, ...] | None = None  # None: none recorded (CRIU keeps its own)
    sched_policy: int = 0
    sched_nice: int = 0
    sched_prio: int = 0


@dataclass(frozen=True)
class ImageCreds:
    """Everything of a checkpoint's images that grants privilege on restore."""

    threads: tuple[ThreadCreds, ...]
    # Tasks whose user namespace is not the dumping CRIU's: CRIU would create one and
    # write its id maps as host root.
    user_namespaces: tuple[int, ...] = ()
    apparmor_policies: bool = False  # apparmor.img: policies CRIU loads into the kernel
    problems: tuple[str, ...] = field(default=())  # structural refusals (missing images...)


@dataclass(frozen=True)
class Violation:
    pid: int
    tid: int
    field: str
    asked: str
    granted: str

    def __str__(self) -> str:
        who = f"pid {self.pid}" if self.tid == self.pid else f"pid {self.pid} thread {self.tid}"
        return f"{who}: {self.field} {self.asked}; the new pod grants {self.granted}"


# -- the comparison (pure) ---------------------------------------------------------------

def cap_names(mask: int) -> str:
    """``CAP_A, CAP_B`` for the bits of ``mask`` ("none" when empty)."""
    names = [CAP_NAMES[i] if i < len(CAP_NAMES) else f"cap{i}"
             for i in range(mask.bit_length()) if mask >> i & 1]
    return ", ".join(names) or "none"


def _rlim(value: int) -> str:
    return "unlimited" if value >= RLIM_INFINITY else str(value)


def violations(images: ImageCreds, granted: Granted) -> list[Violation]:
    """Every way the images' threads exceed ``granted``; empty when none does."""
    out = [Violation(0, 0, "images", problem, "a complete CRIU dump")
           for problem in images.problems]
    for pid in images.user_namespaces:
        out.append(Violation(pid, pid, "user namespace",
                             "asks CRIU to create a user namespace and write its id maps",
                             "the container's own user namespace only"))
    if images.apparmor_policies:
        out.append(Violation(0, 0, "apparmor.img",
                             "asks CRIU to load AppArmor policies into the kernel",
                             "no policy loads"))
    for thread in images.threads:
        out += thread_violations(thread, granted)
    return out


def thread_violations(t: ThreadCreds, g: Granted) -> list[Violation]:
    """How one thread exceeds ``g``: credentials, capabilities, securebits, no_new_privs,
    seccomp, LSM, resource limits and scheduling."""
    found: list[tuple[str, str, str]] = []  # field, asked, granted
    if t.uids is None:
        return [Violation(t.pid, t.tid, "creds", "are missing (CRIU would leave the "
                          "thread with the node's root credentials)", "recorded creds")]
    found += _id_checks("uid", ("uid", "euid", "suid", "fsuid"), t.uids, g.uids,
                        g.has(CAP_SETUID), "CAP_SETUID")
    found += _id_checks("gid", ("gid", "egid", "sgid", "fsgid"), t.gids, g.gids,
                        g.has(CAP_SETGID), "CAP_SETGID")
    extra_groups = sorted(set(t.groups) - g.groups)
    if extra_groups and not g.has(CAP_SETGID):
        found.append(("groups", f"asks supplementary groups {extra_groups}",
                      f"groups {sorted(g.groups)} and no CAP_SETGID"))
    found += _cap_checks(t, g)
    if t.secbits & ~SECBIT_KEEP_CAPS and not g.has(CAP_SETPCAP):
        found.append(("secbits", f"asks {t.secbits:#x}", "no CAP_SETPCAP to set securebits"))
    if g.no_new_privs and not t.no_new_privs:
        found.append(("no_new_privs", "is off", "no_new_privs on"))
    found += _seccomp_checks(t, g)
    found += _lsm_checks(t, g)
    found += _rlimit_checks(t, g)
    found += _sched_checks(t, g)
    return [Violation(t.pid, t.tid, f, a, w) for f, a, w in found]


def _id_checks(kind: str, names: Sequence[str], asked: Sequence[int], held: Sequence[int],
               can_set: bool, cap: str) -> list[tuple[str, str, str]]:
    """Each of the thread's ids must be one the init holds (setres*id without privilege
    picks among real, effective and saved; setfs*id among those and the fs id), unless
    the init may set any."""
    if can_set:
        return []
    allowed = set(held)
    return [(name, f"asks {kind} {value}", f"{kind}s {sorted(allowed)} and no {cap}")
            for name, value in zip(names, asked, strict=True) if value not in allowed]


def _cap_checks(t: ThreadCreds, g: Granted) -> list[tuple[str, str, str]]:
    """capset's rules from the init's sets: the bounding set only shrinks; permitted and
    effective stay within the init's permitted set, ambient too; inheritable within the
    init's inheritable and permitted sets (its bounding set with CAP_SETPCAP)."""
    inh_ceiling = g.cap_inh | (g.cap_bnd if g.cap_eff >> CAP_SETPCAP & 1 else g.cap_prm)
    out = []
    for name, asked, ceiling, what in (
            ("cap_bnd", t.cap_bnd, g.cap_bnd, "bounding set"),
            ("cap_prm", t.cap_prm, g.cap_prm, "permitted set"),
            ("cap_eff", t.cap_eff, g.cap_prm, "permitted set"),
            ("cap_amb", t.cap_amb, g.cap_prm, "permitted set"),
            ("cap_inh", t.cap_inh, inh_ceiling, "inheritable set (with what it may add)")):
        beyond = asked & ~ceiling
        if beyond:
            out.append((name, f"asks {cap_names(beyond)} beyond the container's {what}",
                        cap_names(ceiling)))
    return out


def _seccomp_checks(t: ThreadCreds, g: Granted) -> list[tuple[str, str, str]]:
    """A restored thread is at least as confined as the init: mode strict beats filter
    beats disabled, and a filter chain never has fewer filters than the init's (filters
    are only ever added). The filters' programs are not compared."""
    mode_names = {0: "disabled", 1: "strict", 2: "filter"}
    asked = _SECCOMP_STRENGTH.get(t.seccomp_mode, -1)
    if asked < _SECCOMP_STRENGTH.get(g.seccomp_mode, 0):
        return [("seccomp", f"mode {mode_names.get(t.seccomp_mode, t.seccomp_mode)}",
                 f"seccomp mode {mode_names.get(g.seccomp_mode, g.seccomp_mode)}")]
    if (t.seccomp_mode == g.seccomp_mode == SECCOMP_FILTER
            and t.seccomp_filters < g.seccomp_filters):
        return [("seccomp", f"has {t.seccomp_filters} filters",
                 f"{g.seccomp_filters} seccomp filters in force")]
    return []


def _lsm_checks(t: ThreadCreds, g: Granted) -> list[tuple[str, str, str]]:
    """A confined container's threads keep its label; CRIU never loads AppArmor policy."""
    out = []
    if g.lsm_label is not None and t.lsm_profile != g.lsm_label:
        out.append(("lsm_profile", f"asks {t.lsm_profile or 'none (unconfined)'}",
                    f"LSM label {g.lsm_label}"))
    if t.lsm_sockcreate is not None and t.lsm_sockcreate not in (g.lsm_sockcreate,
                                                                  g.lsm_label):
        out.append(("lsm_sockcreate", f"asks {t.lsm_sockcreate}",
                    f"socket label {g.lsm_sockcreate or g.lsm_label or 'none'}"))
    if t.apparmor_data:
        out.append(("apparmor_data", "asks CRIU to load an AppArmor policy", "no policy loads"))
    return out


def _rlimit_checks(t: ThreadCreds, g: Granted) -> list[tuple[str, str, str]]:
    """No hard limit above the init's (raising one needs CAP_SYS_RESOURCE)."""
    if g.has(CAP_SYS_RESOURCE) or not g.rlimits_max:
        return []
    if t.rlimits_max is None:
        return [("rlimits", "are missing (CRIU would leave the node-agent's)",
                 "the container's limits")]
    out = []
    for resource, (asked, held) in enumerate(zip(t.rlimits_max, g.rlimits_max, strict=False)):
        if asked > held:
            name = _RLIMIT_NAMES[resource] if resource < len(_RLIMIT_NAMES) else str(resource)
            out.append((name, f"asks hard limit {_rlim(asked)}", f"{_rlim(held)}"))
    return out


def _sched_checks(t: ThreadCreds, g: Granted) -> list[tuple[str, str, str]]:
    """Real-time policies only up to the init's RLIMIT_RTPRIO, SCHED_DEADLINE never, and
    a nice value no lower than the init's or what its RLIMIT_NICE allows (sched(7)),
    unless the init holds CAP_SYS_NICE."""
    if g.has(CAP_SYS_NICE):
        return []
    limits = g.rlimits_max
    rtprio = limits[RLIMIT_RTPRIO] if len(limits) > RLIMIT_RTPRIO else 0
    nice_rlim = limits[RLIMIT_NICE] if len(limits) > RLIMIT_NICE else 0
    out = []
    if t.sched_policy == SCHED_DEADLINE:
        out.append(("sched_policy", "asks SCHED_DEADLINE", "no CAP_SYS_NICE"))
    elif t.sched_policy in (SCHED_FIFO, SCHED_RR) and t.sched_prio > rtprio:
        out.append(("sched_prio", f"asks real-time priority {t.sched_prio}",
                    f"RLIMIT_RTPRIO {_rlim(rtprio)} and no CAP_SYS_NICE"))
    lowest = min(g.nice, 20 - min(nice_rlim, 40))
    if t.sched_nice < lowest:
        out.append(("sched_nice", f"asks nice {t.sched_nice}",
                    f"nice {lowest} or higher and no CAP_SYS_NICE"))
    return out


def describe(found: Sequence[Violation]) -> str:
    """One line naming the first violations, each with every thread it applies to, and
    how many more there were."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for v in found:
        thread = f"pid {v.pid}" if v.tid == v.pid else f"pid {v.pid} thread {v.tid}"
        groups.setdefault((v.field, v.asked, v.granted), []).append(thread)
    parts = []
    for (name, asked, granted), whom in list(groups.items())[:_MAX_SHOWN]:
        threads = ", ".join(whom[:_MAX_SHOWN]) + (
            f" and {len(whom) - _MAX_SHOWN} more" if len(whom) > _MAX_SHOWN else "")
        parts.append(f"{threads}: {name} {asked}; the new pod grants {granted}")
    more = (f"; and {len(groups) - _MAX_SHOWN} more"
            if len(groups) > _MAX_SHOWN else "")
    return f"its processes would hold more than the new pod grants: {'; '.join(parts)}{more}"


def check(images: ImageCreds, granted: Granted, what: str) -> None:
    """Raises CheckpointRefused naming ``what`` (the checkpoint) and the violations."""
    found = violations(images, granted)
    if found:
        raise CheckpointRefused(f"{what} is refused: {describe(found)}")


# -- the new container's init (pure parsers of /proc text) -------------------------------

def parse_status(text: str) -> dict[str, str]:
    """``/proc/<pid>/status`` as key -> value."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def parse_limits(text: str) -> tuple[int, ...]:
    """The hard limits of ``/proc/<pid>/limits``, in resource-number order (the kernel
    prints them so): "unlimited" is RLIM_INFINITY."""
    out = []
    for line in text.splitlines()[1:]:
        match = re.match(r"^Max .+?\s{2,}(\S+)\s+(\S+)", line)
        if match:
            hard = match.group(2)
            out.append(RLIM_INFINITY if hard == "unlimited" else int(hard))
    return tuple(out)


def parse_nice(stat_text: str) -> int:
    """The nice value of ``/proc/<pid>/stat`` (field 19; the command name may hold
    spaces and parentheses, so fields are counted after its last ')')."""
    return int(stat_text.rpartition(")")[2].split()[16])


def parse_lsm_label(text: str | None) -> str | None:
    """The profile or context of ``/proc/<pid>/attr/current`` as CRIU records it (the
    part before a space: AppArmor appends the mode); None when unconfined or absent."""
    if not text:
        return None
    label = text.strip("\x00\n ").split(" ")[0]
    return None if label in ("", "unconfined") else label


def granted_from(status: str, limits: str = "", stat: str = "",
                 lsm: str | None = None, sockcreate: str | None = None) -> Granted:
    """The Granted of an init from its /proc texts."""
    s = parse_status(status)

    def ids(key: str) -> tuple[int, int, int, int]:
        a, b, c, d = (int(v) for v in s[key].split())
        return a, b, c, d

    return Granted(
        uids=ids("Uid"), gids=ids("Gid"),
        groups=frozenset(int(v) for v in s.get("Groups", "").split()),
        cap_inh=int(s["CapInh"], 16), cap_prm=int(s["CapPrm"], 16),
        cap_eff=int(s["CapEff"], 16), cap_bnd=int(s["CapBnd"], 16),
        cap_amb=int(s.get("CapAmb", "0"), 16),
        no_new_privs=s.get("NoNewPrivs", "0") == "1",
        seccomp_mode=int(s.get("Seccomp", "0")),
        seccomp_filters=int(s.get("Seccomp_filters", "0")),
        rlimits_max=parse_limits(limits),
        nice=parse_nice(stat) if stat else 0,
        lsm_label=parse_lsm_label(lsm),
        lsm_sockcreate=parse_lsm_label(sockcreate),
    )


# -- the images (pure, over pycriu's decoded dicts) ---------------------------------------

def _caps(words: Iterable[int] | None) -> int:
    """A capability set from CRIU's 32-bit words, lowest first."""
    mask = 0
    for i, word in enumerate(words or ()):
        mask |= (int(word) & 0xFFFFFFFF) << (32 * i)
    return mask


def _seccomp_mode(value: object) -> int:
    if isinstance(value, str):
        return _SECCOMP_NAMES.get(value, -1)
    return int(value) if isinstance(value, int) else SECCOMP_DISABLED


def chain_length(filters: Sequence[Mapping[str, Any]], index: int) -> int:
    """Filters in the chain that starts at ``index`` of seccomp.img (following ``prev``);
    0 for an index out of range. A cycle ends the count (CRIU would refuse it)."""
    seen: set[int] = set()
    while 0 <= index < len(filters) and index not in seen:
        seen.add(index)
        prev = filters[index].get("prev")
        if prev is None:
            break
        index = int(prev)
    return len(seen)


def chain_syncs(filters: Sequence[Mapping[str, Any]], index: int) -> bool:
    """Whether a filter of the chain at ``index`` carries SECCOMP_FILTER_FLAG_TSYNC: CRIU
    then installs the chain on every thread of the task at once, and dumps the other
    threads that share it as disabled (seccomp.c: "will be propagated")."""
    seen: set[int] = set()
    while 0 <= index < len(filters) and index not in seen:
        seen.add(index)
        if int(filters[index].get("flags", 0)) & SECCOMP_FILTER_FLAG_TSYNC:
            return True
        prev = filters[index].get("prev")
        if prev is None:
            break
        index = int(prev)
    return False


def with_leader_seccomp(thread: ThreadCreds, leader: ThreadCreds, syncs: bool) -> ThreadCreds:
    """A non-leader thread dumped as seccomp-disabled gets its leader's chain when CRIU
    restores that chain with TSYNC (``syncs``); otherwise it stays as dumped."""
    if not syncs or thread.seccomp_mode != SECCOMP_DISABLED \
            or leader.seccomp_mode != SECCOMP_FILTER:
        return thread
    return replace(thread, seccomp_mode=SECCOMP_FILTER,
                   seccomp_filters=leader.seccomp_filters)


def thread_creds(pid: int, tid: int, core: Mapping[str, Any],
                 filters: Sequence[Mapping[str, Any]]) -> ThreadCreds:
    """What a thread's core image (``core-<tid>.img``, first entry) asks; ``filters``:
    seccomp.img's filters. A task's per-task fields (rlimits, legacy seccomp) are in its
    main thread's core (CRIU reads them from there)."""
    tc = core.get("tc") or {}
    thread = core.get("thread_core")
    if not isinstance(thread, Mapping) or not isinstance(thread.get("creds"), Mapping):
        return ThreadCreds(pid, tid, None)
    c = thread["creds"]
    mode = thread.get("seccomp_mode", tc.get("old_seccomp_mode", SECCOMP_DISABLED))
    index = thread.get("seccomp_filter", tc.get("old_seccomp_filter", 0))
    mode = _seccomp_mode(mode)
    rlimits = (tc.get("rlimits") or {}).get("rlimits") if "rlimits" in tc else None
    return ThreadCreds(
        pid=pid, tid=tid,
        uids=(int(c["uid"]), int(c["euid"]), int(c["suid"]), int(c["fsuid"])),
        gids=(int(c["gid"]), int(c["egid"]), int(c["sgid"]), int(c["fsgid"])),
        groups=tuple(int(x) for x in c.get("groups", ())),
        cap_inh=_caps(c.get("cap_inh")), cap_prm=_caps(c.get("cap_prm")),
        cap_eff=_caps(c.get("cap_eff")), cap_bnd=_caps(c.get("cap_bnd")),
        cap_amb=_caps(c.get("cap_amb")),
        secbits=int(c.get("secbits", 0)),
        no_new_privs=bool(c.get("no_new_privs", 0)),
        seccomp_mode=mode,
        seccomp_filters=chain_length(filters, int(index)) if mode == SECCOMP_FILTER else 0,
        lsm_profile=c.get("lsm_profile") or None,
        lsm_sockcreate=c.get("lsm_sockcreate") or None,
        apparmor_data=bool(c.get("apparmor_data")),
        rlimits_max=None if rlimits is None else tuple(int(r["max"]) for r in rlimits),
        sched_policy=int(thread.get("sched_policy", 0)),
        sched_nice=int(thread.get("sched_nice", 0)),
        sched_prio=int(thread.get("sched_prio", 0)),
    )


# -- the thin readers ----------------------------------------------------------------------

def _entries(path: Path, limit: int) -> list[dict[str, Any]]:
    return list(criu.load_image(path, limit)["entries"])


def _first(path: Path, limit: int) -> dict[str, Any]:
    entries = _entries(path, limit)
    if not entries:
        raise CheckpointRefused(f"CRIU image {path.name} has no entry")
    return entries[0]


def read_images(images_dir: Path) -> ImageCreds:
    """The credentials of every thread of the tree in ``images_dir`` (pstree.img lists
    the tasks and their threads; each thread's core-<tid>.img holds its creds).
    Raises CheckpointRefused for an image too large or that does not decode."""
    problems: list[str] = []
    pstree = images_dir / "pstree.img"
    if not pstree.exists():
        return ImageCreds((), problems=("there is no pstree.img",))
    tasks = _entries(pstree, MAX_PSTREE_IMAGE_BYTES)
    seccomp = images_dir / "seccomp.img"
    filters = (_first(seccomp, MAX_SECCOMP_IMAGE_BYTES).get("seccomp_filters", [])
               if seccomp.exists() else [])
    root_userns = None
    inventory = images_dir / "inventory.img"
    if inventory.exists():
        root_userns = (_first(inventory, MAX_SMALL_IMAGE_BYTES).get("root_ids") or {}).get(
            "user_ns_id")
    threads: list[ThreadCreds] = []
    userns: list[int] = []
    for task in tasks:
        pid = int(task["pid"])
        tids = [int(t) for t in task.get("threads", [])] or [pid]
        core = images_dir / f"core-{pid}.img"
        if not core.exists():
            problems.append(f"pid {pid} has no core-{pid}.img")
            continue
        main = _first(core, MAX_CORE_IMAGE_BYTES)
        state = int((main.get("tc") or {}).get("task_state", 0))
        if state in (TASK_DEAD, TASK_HELPER):
            continue  # never runs restored code
        ids = main.get("ids")
        ids_img = images_dir / f"ids-{pid}.img"
        if ids is None and ids_img.exists():
            ids = _first(ids_img, MAX_SMALL_IMAGE_BYTES)
        task_userns = (ids or {}).get("user_ns_id")
        if task_userns is not None and task_userns != root_userns:
            userns.append(pid)
        leader = thread_creds(pid, pid, main, filters)
        tc = main.get("tc") or {}
        thread = main.get("thread_core") or {}
        # Images from before per-thread seccomp: CRIU forces TSYNC (seccomp_force_tsync).
        syncs = "old_seccomp_filter" in tc or chain_syncs(
            filters, int(thread.get("seccomp_filter", tc.get("old_seccomp_filter", 0))))
        threads.append(leader)
        for tid in tids:
            if tid == pid:
                continue
            core_tid = images_dir / f"core-{tid}.img"
            if not core_tid.exists():
                problems.append(f"thread {tid} of pid {pid} has no core-{tid}.img")
                continue
            # Per-task fields live in the main thread's core.
            entry = {**_first(core_tid, MAX_CORE_IMAGE_BYTES), "tc": main.get("tc") or {}}
            threads.append(with_leader_seccomp(thread_creds(pid, tid, entry, filters), leader,
                                               syncs))
    return ImageCreds(tuple(threads), user_namespaces=tuple(userns),
                      apparmor_policies=(images_dir / "apparmor.img").exists(),
                      problems=tuple(problems))


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(65536)
    except OSError:
        return None


def read_granted(init_pid: int) -> Granted:
    """What the new container's init (host pid ``init_pid``) holds, from /proc."""
    base = f"/proc/{init_pid}"
    status = _read(f"{base}/status")
    if status is None:
        # The container's state, not the checkpoint's: another try may work.
        raise RestoreFailed(f"cannot read {base}/status of the new container's init")
    lsm = _read(f"{base}/attr/apparmor/current") or _read(f"{base}/attr/current")
    return granted_from(status, _read(f"{base}/limits") or "", _read(f"{base}/stat") or "",
                        lsm, _read(f"{base}/attr/sockcreate"))
