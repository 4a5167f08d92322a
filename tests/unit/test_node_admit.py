"""The manifest policy (hermit_node.engine.admit): a table of malicious manifests, privileges,
the restore section's workspace, and free space."""

from __future__ import annotations

import copy
import json
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hermit_common.errors import CheckpointRefused, RestoreFailed
from hermit_common.manifest import Binding, Manifest, Totals
from hermit_common.tree import Entry
from hermit_node.engine import admit
from hermit_node.engine.admit import FROM_IMAGE, STRIP, ImageFile, SpaceNeed
from hermit_node.engine.checkpoint import restore_info
from hermit_node.host.container import BindMount, ContainerView

D1, D2, D3 = "a1" * 32, "b2" * 32, "c3" * 32
CAP = b"\x01\x00\x00\x02\x00\x20\x00\x00" + bytes(12)  # any security.capability value
CAP_B64 = "AQAAAgAgAAAAAAAAAAAAAAAAAAA="


def _file(path: str, size: int, chunks: list[str], mode: int = 0o644,
          **extra: Any) -> dict[str, Any]:
    return {"path": path, "kind": "file", "mode": mode, "uid": 0, "gid": 0, "mtime_ns": 1,
            "size": size, "chunks": chunks, **extra}


def _dir(path: str, mode: int = 0o755, **extra: Any) -> dict[str, Any]:
    return {"path": path, "kind": "dir", "mode": mode, "uid": 0, "gid": 0, "mtime_ns": 1,
            **extra}


def _symlink(path: str, target: str) -> dict[str, Any]:
    return {"path": path, "kind": "symlink", "mode": 0o777, "uid": 0, "gid": 0, "mtime_ns": 1,
            "target": target}


def _fifo(path: str) -> dict[str, Any]:
    return {"path": path, "kind": "fifo", "mode": 0o644, "uid": 0, "gid": 0, "mtime_ns": 1}


def legit() -> dict[str, Any]:
    """A manifest as a real checkpoint writes it (chunk size 4): every kind where allowed."""
    sections = {
        "criu": [_file("core-1.img", 6, [D1, D2], 0o600), _file("dump.log", 3, [D3])],
        "rootfs": [
            _dir("etc"), {"path": "etc/gone", "kind": "whiteout"},
            _symlink("etc/localtime", "/usr/share/zoneinfo/UTC"),
            _dir("home", opaque=True), _file("home/notes", 8, [D1, D1]),
            _file("home/notes-too", 8, [D1, D1], link="home/notes"),
            _fifo("home/pipe"), _dir("shared", 0o2775),
        ],
        "workspace": [_dir("proj"), _file("proj/main.py", 4, [D2]),
                      _symlink("proj/abs", "/etc/hosts"), _fifo("proj/fifo")],
    }
    return {
        "format_version": 1,
        "binding": {"namespace": "team-a", "sandbox": "agent-1", "sandbox_uid": "uid-1",
                    "checkpoint": "ckpt-1", "criu_version": "4.2", "kernel": "6.1",
                    "cpu_flags": [], "image_digest": None},
        "created_at": "2025-01-01T00:00:00.000000Z",
        "chunk_size": 4,
        "sections": sections,
        "restore": {"engine": 1, "netnsKey": "extnet", "mounts": {"m0": "/workspace",
                                                                  "m1": "/etc/resolv.conf"},
                    "cgroupMounts": {"cg0": ["cpu", "cpuacct"], "cg1": ["name=systemd"]},
                    "workspace": "/workspace", "stdio": {"pipe:[123]": 1, "pipe:[124]": 2},
                    "hadUpperdir": True},
        "totals": {"files": 5, "image_bytes": 29, "chunks": 8, "unique_chunks": 3,
                   "stored_bytes": 30},
    }


def _no_image(_path: str) -> ImageFile | None:
    return None


def _admit(doc: dict[str, Any], *, workspace_path: str | None = "/workspace",
           mounted: bool = True,
           image: admit.ImageLookup = _no_image) -> admit.Admitted:
    manifest = Manifest.from_json(json.dumps(doc).encode())
    return admit.admit(manifest, workspace_path=workspace_path, workspace_mounted=mounted,
                       image=image)


def test_a_legitimate_manifest_passes_unchanged() -> None:
    doc = legit()
    admitted = _admit(doc)
    manifest = Manifest.from_json(json.dumps(doc).encode())
    assert admitted.sections == manifest.sections
    assert admitted.stripped == ()
    assert admitted.workspace == "/workspace"


def test_the_restore_section_a_checkpoint_writes_passes() -> None:
    """admit accepts what checkpoint.restore_info produces (the two stay in step)."""
    view = ContainerView(
        init_pid=1, bundle=Path("/b"), rootfs=Path("/b/rootfs"), upperdir=None,
        netns_inode=1, stdio=("/dev/null", "pipe:[77]", "pipe:[78]"),
        bind_mounts=(BindMount("/workspace", "/host/ws"), BindMount("/etc/hosts", "/h")))
    info = restore_info(view, "/workspace", {"m0": "/workspace", "m1": "/etc/hosts"},
                        {"cg0": ["cpu", "cpuacct"]})
    doc = legit()
    doc["restore"] = json.loads(json.dumps(info))
    assert _admit(doc).workspace == "/workspace"


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        target = doc
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return change


def _append(section: str, *entries: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        doc["sections"].setdefault(section, []).extend(entries)
    return change


def _criu_entry(**fields: Any) -> Callable[[dict[str, Any]], None]:
    return _set(["sections", "criu", 0], {**legit()["sections"]["criu"][0], **fields})


def _swap_rootfs(doc: dict[str, Any]) -> None:
    rootfs = doc["sections"]["rootfs"]
    rootfs[3], rootfs[4] = rootfs[4], rootfs[3]  # home/notes before home


def _del(path: list[Any]) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        target = doc
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
    return change


def _without_workspace(doc: dict[str, Any]) -> None:
    del doc["sections"]["workspace"]
    doc["totals"].update(files=4, image_bytes=25, chunks=7)


def _disk_filler(doc: dict[str, Any]) -> None:
    """One chunk repeated to make a 40 GB file, with the small totals left as they were."""
    count = 10 ** 10 // 4
    doc["sections"]["workspace"].append(_file("proj/zeros", count * 4, [D1] * 1000))


MALICIOUS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    # The CRIU images: regular files only, nothing privileged, no hardlinks.
    "criu symlink to a host file": (
        _append("criu", _symlink("pages-1.img", "/etc/shadow")),
        r"criu/pages-1.img is a symlink; the 'criu' section holds only file"),
    "criu fifo": (_append("criu", _fifo("pipe.img")), r"criu/pipe.img is a fifo"),
    "criu directory": (_append("criu", _dir("sub")), r"criu/sub is a dir"),
    "criu whiteout": (_append("criu", {"path": "x", "kind": "whiteout"}), r"criu/x is a whiteout"),
    "criu hardlink": (
        _append("criu", _file("pages-1.img", 6, [D1, D2], 0o600, link="core-1.img")),
        r"criu/pages-1.img is a hardlink of 'core-1.img'"),
    "criu setuid": (_criu_entry(mode=0o4755), r"criu/core-1.img has setuid; .* never does"),
    "criu setgid": (_criu_entry(mode=0o2755), r"criu/core-1.img has setgid"),
    "criu file capability": (_criu_entry(xattrs={"security.capability": CAP_B64}),
                             r"criu/core-1.img has file capability"),
    "no criu section": (_del(["sections", "criu"]), r"has no 'criu' section"),
    "unknown section": (_set(["sections", "etc"], []), r"sections \['etc'\] a restore does not"),
    # The workspace: no whiteouts (device 0:0).
    "workspace whiteout": (_append("workspace", {"path": "x", "kind": "whiteout"}),
                           r"workspace/x is a whiteout; the 'workspace' section holds only"),
    # Paths: relative, normalized, never through a symlink, parents first.
    "dot-dot path": (_append("rootfs", _file("../escape", 0, [])), r"'\.\.' component"),
    "dot-dot inside": (_append("rootfs", _file("etc/../../escape", 0, [])),
                       r"'\.\.' component"),
    "absolute path": (_append("rootfs", _file("/etc/passwd", 0, [])), r"is absolute"),
    "dot path": (_append("rootfs", _file("etc/./passwd", 0, [])), r"'\.' or '\.\.'"),
    "empty component": (_append("rootfs", _file("etc//passwd", 0, [])), r"empty"),
    "NUL in path": (_append("rootfs", _file("etc/pass\x00wd", 0, [])), r"NUL"),
    "symlink then write through it": (
        _append("rootfs", _symlink("esc", "/etc"), _file("esc/passwd", 0, [])),
        r"'esc/passwd' has no parent directory entry"),
    "symlink then a dir under it": (
        _append("workspace", _symlink("esc", "/"), _dir("esc/root")),
        r"'esc/root' has no parent directory entry"),
    "child listed before its directory": (_swap_rootfs, r"'home/notes' has no parent "
                                                        r"directory entry listed before it"),
    "a path listed twice": (_append("rootfs", _file("etc/gone", 0, [])), r"lists 'etc/gone' twice"),
    "hardlink into another section": (
        _append("rootfs", _file("stolen", 6, [D1, D2], 0o600, link="core-1.img")),
        r"hardlink of 'core-1.img', which is not an earlier file"),
    "unknown kind": (_append("rootfs", {**_fifo("dev/sda"), "kind": "blockdev"}),
                     r"unknown kind 'blockdev'"),
    "overlay xattr": (_append("rootfs", _dir("x", xattrs={"trusted.overlay.redirect": "eA=="})),
                      r"'trusted.overlay.redirect', which is never captured"),
    # Sizes: the totals are what the entries hold.
    "fewer bytes declared": (_set(["totals", "image_bytes"], 1),
                             r"image_bytes 1 \(the entries hold 29\)"),
    "fewer files declared": (_set(["totals", "files"], 1), r"files 1 \(the entries hold 5\)"),
    "fewer chunks declared": (_set(["totals", "chunks"], 2), r"chunks 2 \(the entries hold 8\)"),
    "fewer unique chunks": (_set(["totals", "unique_chunks"], 1), r"unique_chunks 1"),
    "a chunk repeated to fill the disk": (_disk_filler, r"lists 1000 chunks, expected"),
    # The restore section: the workspace is the new pod's, keys are plain tokens.
    "workspace is /etc": (_set(["restore", "workspace"], "/etc"),
                          r"restore.workspace names /etc, but the new pod's workspace is "
                          r"/workspace; a restore replaces no other mount"),
    "workspace is another mount": (_set(["restore", "workspace"], "/etc/resolv.conf"),
                                   r"names /etc/resolv.conf, but the new pod's workspace"),
    "workspace is the root": (_set(["restore", "workspace"], "/"),
                              r"restore.workspace '/' is not an absolute, normalized"),
    "workspace with dot-dot": (_set(["restore", "workspace"], "/workspace/../etc"),
                               r"restore.workspace '/workspace/\.\./etc' is not"),
    "workspace relative": (_set(["restore", "workspace"], "workspace"), r"is not an absolute"),
    "workspace not a string": (_set(["restore", "workspace"], ["/workspace"]),
                               r"is not an absolute"),
    "workspace section without restore.workspace": (
        _set(["restore", "workspace"], None), r"has a workspace section but restore.workspace"),
    "restore.workspace without a section": (
        _without_workspace, r"names /workspace but it has no workspace section"),
    "mount key rewrites a CRIU option": (_set(["restore", "mounts", "m0]:/etc"], "/workspace"),
                                         r"restore.mounts has an invalid entry 'm0\]:/etc'"),
    "mount destination relative": (_set(["restore", "mounts", "m0"], "workspace"),
                                   r"restore.mounts has an invalid entry 'm0'"),
    "mounts not an object": (_set(["restore", "mounts"], ["m0"]), r"restore.mounts is not an"),
    "cgroup controller injection": (_set(["restore", "cgroupMounts", "cg0"], ["cpu]:/"]),
                                    r"restore.cgroupMounts has an invalid entry 'cg0'"),
    "stdio fd 5": (_set(["restore", "stdio", "pipe:[123]"], 5),
                   r"restore.stdio has an invalid entry 'pipe:\[123\]'"),
    "stdio fd true": (_set(["restore", "stdio", "pipe:[123]"], True), r"restore.stdio has an"),
    "stdio key injection": (_set(["restore", "stdio", "pipe:[1]]:x"], 1), r"restore.stdio has"),
    "netns key injection": (_set(["restore", "netnsKey"], "extnet]:x"),
                            r"restore.netnsKey 'extnet\]:x' is not a plain token"),
    "unknown engine": (_set(["restore", "engine"], 2), r"restore.engine 2 is not 1"),
    "hadUpperdir not a boolean": (_set(["restore", "hadUpperdir"], "yes"),
                                  r"restore.hadUpperdir is not a boolean"),
}


@pytest.mark.parametrize("name", sorted(MALICIOUS))
def test_malicious_manifests_are_refused(name: str) -> None:
    change, message = MALICIOUS[name]
    doc = copy.deepcopy(legit())
    change(doc)
    with pytest.raises(CheckpointRefused, match=message) as refused:
        _admit(doc)
    assert "\n" not in str(refused.value)


def test_refusals_name_the_checkpoint() -> None:
    doc = legit()
    doc["restore"]["workspace"] = "/etc"
    with pytest.raises(CheckpointRefused, match=r"^checkpoint team-a/ckpt-1 is refused: "):
        _admit(doc)
    doc = legit()
    doc["totals"]["files"] = 9
    with pytest.raises(CheckpointRefused, match=r"^checkpoint team-a/ckpt-1 is refused: its "):
        _admit(doc)


def test_the_workspace_must_be_the_new_pods() -> None:
    # The pod's workspace moved (a fork into a sandbox with another mountPath).
    with pytest.raises(CheckpointRefused, match=r"names /workspace, but the new pod's "
                                                r"workspace is /work"):
        _admit(legit(), workspace_path="/work")
    with pytest.raises(CheckpointRefused, match=r"the new pod's workspace is none"):
        _admit(legit(), workspace_path=None)
    # The same path spelled with a trailing slash by the pod is the same mount.
    assert _admit(legit(), workspace_path="/workspace/").workspace == "/workspace"
    # The pod says /workspace but its container has no mount there: the pod's problem.
    with pytest.raises(RestoreFailed, match="no workspace mount at /workspace") as failed:
        _admit(legit(), mounted=False)
    assert not isinstance(failed.value, CheckpointRefused)


def test_no_workspace_on_either_side_is_fine() -> None:
    doc = legit()
    _without_workspace(doc)
    doc["restore"]["workspace"] = None
    assert _admit(doc, workspace_path=None).workspace is None
    assert _admit(doc).workspace is None


# -- privileges ---------------------------------------------------------------------------

def _entry(path: str, mode: int, uid: int = 0, gid: int = 0, *, cap: bytes | None = None,
           link: str | None = None, kind: str = "file") -> Entry:
    xattrs = (("security.capability", cap),) if cap is not None else ()
    return Entry(path, kind, mode, uid, gid, 1, xattrs=xattrs, link=link)


class FakeImage:
    """An image as a dict; records which paths were asked about."""

    def __init__(self, files: dict[str, ImageFile]) -> None:
        self.files = files
        self.asked: list[str] = []

    def __call__(self, path: str) -> ImageFile | None:
        self.asked.append(path)
        return self.files.get(path)


IMAGE = FakeImage({
    "usr/bin/su": ImageFile(stat.S_IFREG | 0o4755, 0, 0, None),
    "usr/bin/games": ImageFile(stat.S_IFREG | 0o4755, 5, 60, None),
    "usr/bin/wall": ImageFile(stat.S_IFREG | 0o2755, 0, 5, None),
    "usr/bin/both": ImageFile(stat.S_IFREG | 0o6755, 0, 0, None),
    "usr/bin/ping": ImageFile(stat.S_IFREG | 0o755, 0, 0, CAP),
    "usr/bin/plain": ImageFile(stat.S_IFREG | 0o755, 0, 0, None),
    "usr/bin/fifo": ImageFile(stat.S_IFIFO | 0o4755, 0, 0, None),
})


@pytest.mark.parametrize(("entry", "mode", "cap", "why"), [
    (_entry("usr/bin/su", 0o4755), 0o4755, None, None),  # the image's bit, same owner
    (_entry("usr/bin/su", 0o4755, uid=1000), 0o755, None, "setuid"),  # setuid to another uid
    (_entry("usr/bin/games", 0o4755), 0o755, None, "setuid"),  # setuid root, image: games
    (_entry("usr/bin/games", 0o4755, uid=5), 0o4755, None, None),
    (_entry("usr/bin/wall", 0o2755, gid=5), 0o2755, None, None),
    (_entry("usr/bin/wall", 0o2755, gid=0), 0o755, None, "setgid"),  # another group
    (_entry("usr/bin/wall", 0o6755, gid=5), 0o2755, None, "setuid"),  # only setgid granted
    (_entry("usr/bin/both", 0o6755), 0o6755, None, None),
    (_entry("usr/bin/plain", 0o6755), 0o755, None, "setuid, setgid"),
    (_entry("usr/local/bin/new", 0o4711), 0o711, None, "setuid"),  # not in the image
    (_entry("usr/bin/ping", 0o755, cap=CAP), 0o755, CAP, None),  # the image's capability
    (_entry("usr/bin/ping", 0o755, cap=CAP + b"x"), 0o755, None, "file capability"),
    (_entry("usr/bin/plain", 0o755, cap=CAP), 0o755, None, "file capability"),
    (_entry("usr/bin/fifo", 0o4755, kind="fifo"), 0o755, None, "setuid"),  # not a file
    (_entry("usr/bin/su", 0o4755, kind="dir"), 0o4755, None, None),  # means nothing on a dir
    (_entry("shared", 0o2775, kind="dir"), 0o2775, None, None),  # group inheritance
])
def test_privileges_from_the_image(entry: Entry, mode: int, cap: bytes | None,
                                   why: str | None) -> None:
    (out,), stripped = admit.drop_privileges([entry], FROM_IMAGE, IMAGE)
    assert out.mode == mode
    assert dict(out.xattrs).get("security.capability") == cap
    assert stripped == ([f"{entry.path} ({why})"] if why else [])


def test_the_workspace_strips_every_privilege() -> None:
    image = FakeImage(dict(IMAGE.files))
    entries = [_entry("usr/bin/su", 0o4755), _entry("usr/bin/ping", 0o755, cap=CAP),
               _entry("d", 0o2775, kind="dir"), _entry("plain", 0o644)]
    out, stripped = admit.drop_privileges(entries, STRIP, image)
    assert [e.mode for e in out] == [0o755, 0o755, 0o2775, 0o644]
    assert out[1].xattrs == ()
    assert stripped == ["usr/bin/su (setuid)", "usr/bin/ping (file capability)"]
    assert image.asked == []


def test_hardlinked_names_share_one_decision() -> None:
    """One inode, one mode: kept only if every name of it is granted by the image."""
    first = _entry("usr/bin/su", 0o4755)
    out, stripped = admit.drop_privileges(
        [first, _entry("home/su-too", 0o4755, link="usr/bin/su")], FROM_IMAGE, IMAGE)
    assert [e.mode for e in out] == [0o755, 0o755]
    assert stripped == ["usr/bin/su (setuid)", "home/su-too (setuid)"]
    # Stripped the same way, the names still pass check_links as one inode.
    Manifest(binding=Binding("n", "s", "u", "c", "4.2", "6.1"), created_at="t", chunk_size=4,
             sections={"rootfs": (Entry("home", "dir"), Entry("usr", "dir"),
                                  Entry("usr/bin", "dir"), *out)},
             restore={}, totals=Totals())


def test_the_image_is_asked_only_about_privileged_entries() -> None:
    image = FakeImage(dict(IMAGE.files))
    entries = [_entry(f"f{i}", 0o755) for i in range(100)] + [_entry("usr/bin/su", 0o4755)]
    admit.drop_privileges(entries, FROM_IMAGE, image)
    assert image.asked == ["usr/bin/su"]


def test_admit_strips_the_rootfs_by_the_image_and_the_workspace_always() -> None:
    doc = legit()
    doc["sections"]["rootfs"] += [_dir("usr"), _dir("usr/bin"),
                                  _file("usr/bin/su", 0, [], 0o4755),
                                  _file("usr/bin/sudo", 0, [], 0o4755)]
    doc["sections"]["workspace"].append(_file("proj/su", 0, [], 0o4755))
    doc["totals"]["files"] += 3
    admitted = _admit(doc, image=IMAGE)
    assert admitted.stripped == ("rootfs/usr/bin/sudo (setuid)", "workspace/proj/su (setuid)")
    modes = {f"{s}/{e.path}": e.mode for s, es in admitted.sections.items() for e in es}
    assert modes["rootfs/usr/bin/su"] == 0o4755
    assert modes["rootfs/usr/bin/sudo"] == modes["workspace/proj/su"] == 0o755
    assert admit.describe_stripped(admitted.stripped) == \
        "2 paths: rootfs/usr/bin/sudo (setuid), workspace/proj/su (setuid)"
    many = admit.describe_stripped([f"p{i}" for i in range(25)])
    assert many.startswith("25 paths: p0, p1,") and many.endswith("p9 and 15 more")


# -- free space ---------------------------------------------------------------------------

def test_space_needs_count_the_download_and_each_target() -> None:
    manifest = Manifest.from_json(json.dumps(legit()).encode())
    needs = admit.space_needs(manifest, staging="/work", rootfs="/upper", workspace="/ws")
    # The download holds every file, a hardlink too; the apply links it instead.
    assert [(n.what, n.path, n.needed) for n in needs] == [
        ("the download", "/work", 29), ("the rootfs section", "/upper", 8),
        ("the workspace section", "/ws", 4)]
    assert [n.path for n in admit.space_needs(manifest, staging="/w", rootfs=None,
                                              workspace=None)] == ["/w"]


def test_free_space_is_checked_per_filesystem() -> None:
    admit.check_free_space([SpaceNeed("the download", "/work", 600, device=1, free=1000),
                            SpaceNeed("the rootfs section", "/upper", 400, device=1, free=1000),
                            SpaceNeed("the workspace section", "/ws", 900, device=2, free=900)])
    with pytest.raises(RestoreFailed) as failed:
        admit.check_free_space([
            SpaceNeed("the download", "/work", 600, device=1, free=1000),
            SpaceNeed("the rootfs section", "/upper", 401, device=1, free=1000)])
    assert str(failed.value) == (
        "not enough free space: 600 bytes for the download in /work + 401 bytes for the "
        "rootfs section in /upper = 1001 bytes needed, 1000 bytes free on that filesystem")
    # Free space is this node's state, not the checkpoint's: another try may work.
    assert not isinstance(failed.value, CheckpointRefused)


def test_a_repeated_chunk_is_bounded_by_the_totals_and_free_space() -> None:
    """A chunk repeated to fill the disk must be declared in the totals (or the manifest is
    refused), and what is declared is what the free-space check counts before the
    download starts."""
    doc = legit()
    count = 25_000
    doc["sections"]["workspace"].append(_file("proj/zeros", count * 4, [D1] * count))
    doc["totals"].update(files=6, image_bytes=29 + count * 4, chunks=8 + count)
    assert _admit(doc).workspace == "/workspace"  # consistent totals pass the policy
    manifest = Manifest.from_json(json.dumps(doc).encode())
    needs = [SpaceNeed(n.what, n.path, n.needed, device=1, free=64 * 1024)
             for n in admit.space_needs(manifest, staging="/work", rootfs="/upper",
                                        workspace="/ws")]
    assert needs[0].needed == 29 + count * 4
    with pytest.raises(RestoreFailed, match=r"= 200041 bytes needed, 65536 bytes free"):
        admit.check_free_space(needs)


def test_odd_names_stay_on_one_line() -> None:
    doc = legit()
    doc["sections"]["criu"].append(_symlink("evil\nname\udce9.img", "/etc/shadow"))
    with pytest.raises(CheckpointRefused, match=r"criu/evil\\nname\\udce9.img is a symlink"):
        _admit(doc)
    _, stripped = admit.drop_privileges([_entry("a\nb", 0o4755)], STRIP, IMAGE)
    assert stripped == ["a\\nb (setuid)"]
