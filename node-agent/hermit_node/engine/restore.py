"""Restore a checkpoint into a new container whose PID 1 is ``hermit-init --restore``.

Order matters: read the manifest, check the node can run it and that it passes the
manifest policy (admit.py) and fits on the node's disks, download and verify
everything, check that no restored process would hold more privilege than the new
container's init (credcheck.py), apply the writable layer and the workspace, and
only then let CRIU read the images.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hermit_common import protocol
from hermit_common.chunkcache import CacheTally
from hermit_common.errors import CheckpointRefused, RestoreFailed
from hermit_common.manifest import Manifest
from hermit_common.pin import Pin
from hermit_common.store import CheckpointStore, Deferred
from hermit_node.engine import admit, lazypages, pagesource, staging
from hermit_node.engine.checkpoint import (
    NETNS_KEY,
    SECTION_IMAGES,
    SECTION_ROOTFS,
    SECTION_WORKSPACE,
)
from hermit_node.engine.fsapply import apply_tree
from hermit_node.engine.imagefiles import image_lookup
from hermit_node.engine.restore_worker import WorkerRequest
from hermit_node.host import container, credcheck, criu, fdcheck, mountcheck, sysinfo
from hermit_node.host.criu import Criu, RestoreRequest

log = logging.getLogger(__name__)

# A lazy restore's daemon that has not copied every page in by then fails, and its tree
# is killed (lazypages.watch).
LAZY_FILL_TIMEOUT_SECONDS = 600.0


@dataclass(frozen=True)
class RestoreTarget:
    # Which checkpoint, pinned how: its sandbox's uid (required: every manifest is bound
    # to it) and, when known, its Checkpoint's status.manifestDigest, parent and lineage.
    pin: Pin
    init_pid: int  # host pid of the new container's PID 1 (hermit-init --restore)
    bundle: Path | None = None
    image_digest: str | None = None  # of the new container; must match the checkpoint's
    # The new pod's workspace mount point (None: it has none): the only mount a restore
    # empties and refills, whatever the manifest's restore.workspace says.
    workspace_path: str | None = protocol.DEFAULT_WORKSPACE_PATH

    @property
    def namespace(self) -> str:
        return self.pin.namespace

    @property
    def sandbox(self) -> str:
        return self.pin.sandbox

    @property
    def checkpoint(self) -> str:
        return self.pin.checkpoint


@dataclass(frozen=True)
class RestoreResult:
    download_ms: int
    apply_ms: int
    restore_ms: int
    total_ms: int
    restored_pid: int  # root of the restored tree, as seen in the container
    downloaded_bytes: int
    # The tree runs while CRIU's lazy-pages daemon copies its memory in (restore_ms is
    # then the time to running, not to every page being in).
    lazy: bool = False
    # Distinct chunks fetched before the tree ran (a lazy restore's deferred pages are not
    # counted), and how many of them came from the node's chunk cache (chunkcache.py).
    chunks_fetched: int = 0
    chunks_cached: int = 0


def check_compatible(manifest: Manifest, *, criu_version: str, cpu_flags: tuple[str, ...],
                     image_digest: str | None) -> None:
    """Refuse, before CRIU sees a byte, a checkpoint this node cannot run."""
    b = manifest.binding
    missing = sysinfo.missing_cpu_flags(b.cpu_flags, cpu_flags)
    if missing:
        raise CheckpointRefused(
            f"checkpoint {b.namespace}/{b.checkpoint} needs CPU features this node lacks: "
            f"{', '.join(missing)}")
    if _major_minor(criu_version) < _major_minor(b.criu_version):
        raise CheckpointRefused(
            f"checkpoint {b.namespace}/{b.checkpoint} was made by CRIU {b.criu_version}; "
            f"this node has the older {criu_version}")
    if b.image_digest and image_digest and b.image_digest != image_digest:
        raise CheckpointRefused(
            f"checkpoint {b.namespace}/{b.checkpoint} was taken from image {b.image_digest}, "
            f"the new container runs {image_digest}")


def _major_minor(version: str) -> tuple[int, int]:
    parts = ([*version.split("."), "0", "0"])[:2]
    try:
        return int(parts[0]), int(parts[1])
    except ValueError:
        return (0, 0)


def _ms(start: float) -> int:
    return int((time.monotonic() - start) * 1000)


@dataclass(frozen=True)
class _Externals:
    """The checkpoint's external resources, mapped onto the new container."""

    externals: list[str]  # CRIU --external mnt[key]:host-path
    cgroup_sources: list[str]  # host cgroup dirs bind-mounted into the restored tree
    stdio_keys: dict[str, int]  # CRIU inherit-fd key -> fd of the container's init


def _map_externals(info: Mapping[str, Any], view: container.ContainerView) -> _Externals:
    """Maps the checkpoint's bind mounts, cgroup v1 mounts and stdio pipes onto ``view``.

    Raises RestoreFailed when the new container lacks one of them.
    """
    externals = []
    for key, destination in dict(info.get("mounts", {})).items():
        source = view.bind_source(str(destination))
        if source is None:
            raise RestoreFailed(
                f"the new container has no mount at {destination}, which the checkpoint "
                "had; give the new pod the same volumes")
        externals.append(f"mnt[{key}]:{source}")
    cgroup_sources = []
    for key, controllers in dict(info.get("cgroupMounts", {})).items():
        group = view.cgroup_host_path(frozenset(str(c) for c in controllers))
        if group is None:
            raise RestoreFailed(
                f"the new container has no cgroup v1 hierarchy {','.join(controllers)}, "
                "which the checkpoint had mounted")
        externals.append(f"mnt[{key}]:{group}")
        cgroup_sources.append(str(group))
    stdio_keys = {str(k): int(v) for k, v in dict(info.get("stdio", {})).items()}
    for key, fd in stdio_keys.items():
        if not view.stdio[fd].startswith("pipe:"):
            raise RestoreFailed(
                f"fd {fd} of the new container's init is {view.stdio[fd]!r}, not a pipe; "
                f"cannot reconnect the checkpoint's {key}")
    return _Externals(externals, cgroup_sources, stdio_keys)


def _apply_files(admitted: admit.Admitted, local: Path, view: container.ContainerView) -> None:
    """Applies the checkpoint's writable layer and workspace onto the new container."""
    rootfs = admitted.sections.get(SECTION_ROOTFS)
    if rootfs:
        # The new container's own mounts (resolv.conf, hosts, volumes) stay as they are.
        apply_tree(rootfs, local / SECTION_ROOTFS, view.rootfs,
                   skip=[m.destination for m in view.bind_mounts])
    if admitted.workspace is not None:
        source = view.bind_source(admitted.workspace)
        if source is None:
            raise RestoreFailed(
                f"the new container has no workspace mount at {admitted.workspace}")
        apply_tree(admitted.sections[SECTION_WORKSPACE], local / SECTION_WORKSPACE,
                   Path(source), replace=True)


def check_images(target: RestoreTarget, images: Path, *, lazy: bool = False) -> None:
    """Before anything is applied or CRIU reads a byte: no process of the images holds
    more than the new container's init (credcheck.py) nor open a file that carries a
    capability it lacks (fdcheck.py), their mounts, narrowed to its mounts' flags, are
    no wider than its mounts (mountcheck.py), and the pagemaps a lazy restore parses
    itself are within their bound. Raises CheckpointRefused."""
    what = f"checkpoint {target.namespace}/{target.checkpoint}"
    try:
        granted = credcheck.read_granted(target.init_pid)
        credcheck.check(credcheck.read_images(images), granted, what)
        fdcheck.check(images, granted, what)
        container_mounts = mountcheck.read_container_mounts(target.init_pid)
        namespaces, narrowed = mountcheck.narrow_image_mounts(images, container_mounts)
        if narrowed:
            log.info("%s: mounts restored as narrow as the new pod's: %s", what,
                     ", ".join(narrowed))
        mountcheck.check(namespaces, container_mounts,
                         granted.has(credcheck.CAP_SYS_ADMIN), what)
        if lazy:
            criu.read_pagemaps(images)
    except CheckpointRefused as exc:
        message = str(exc)
        raise CheckpointRefused(message if message.startswith(what)
                                else f"{what} is refused: {message}") from None
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        # Decoded but not shaped as CRIU writes them (a field of the wrong type...).
        raise CheckpointRefused(f"{what} is refused: its CRIU images are malformed: "
                                f"{type(exc).__name__}: {str(exc)[:200]}") from None


def _free_space(need: admit.SpaceNeed) -> admit.SpaceNeed:
    """``need`` with its filesystem's device and the bytes free there (for unprivileged
    users: the blocks reserved for root stay for the node)."""
    vfs = os.statvfs(need.path)
    return dataclasses.replace(need, device=os.stat(need.path).st_dev,
                               free=vfs.f_bavail * vfs.f_frsize)


def check_room(manifest: Manifest, admitted: admit.Admitted, local: Path,
               view: container.ContainerView) -> None:
    """The download and the apply fit on their filesystems; RestoreFailed if not."""
    workspace = view.bind_source(admitted.workspace) if admitted.workspace else None
    # The writable layer lands in the upperdir; its filesystem is the one to group with
    # the work dir's (the overlay mount has a device of its own).
    upper = view.upperdir if view.upperdir is not None and view.upperdir.is_dir() \
        else view.rootfs
    needs = admit.space_needs(manifest, staging=str(local), rootfs=str(upper),
                              workspace=workspace)
    admit.check_free_space([_free_space(n) for n in needs])


class RestoreEngine:
    def __init__(self, criu: Criu, store: CheckpointStore, work_dir: Path, *,
                 lazy: bool = False,
                 on_lazy_fill: Callable[[lazypages.Filled], None] | None = None,
                 cgroup_root: Path = container.DEFAULT_CGROUP_ROOT) -> None:
        """``on_lazy_fill`` hears how every lazy restore's fill ended (the agent counts
        them): the engine itself knows neither metrics nor Kubernetes."""
        self._criu = criu
        self._store = store
        self._work_dir = work_dir
        self.lazy = lazy and self._lazy_works()
        self._on_lazy_fill = on_lazy_fill
        self._cgroup_root = cgroup_root  # the node's cgroup filesystem

    def _lazy_works(self) -> bool:
        reason = lazypages.unavailable(self._criu.binary)
        if reason is not None:
            log.warning("HERMIT_LAZY_RESTORE is on, but this node cannot restore lazily "
                        "(%s): restores copy all memory in before the sandbox runs", reason)
        return reason is None

    def local_dir(self, target: RestoreTarget) -> Path:
        """This restore's own staging dir. Keyed by the new container too (its init's
        host pid): restores of one checkpoint into several pods at once (forks fanning
        out) share nothing mutable; the chunks they have in common come from the
        node's chunk cache, read-only."""
        return (self._work_dir / "restores" / target.namespace / target.sandbox
                / target.checkpoint / f"into-{target.init_pid}")

    def restore(self, target: RestoreTarget, *, timeout: float = 120.0,
                store: CheckpointStore | None = None,
                on_filled: Callable[[lazypages.Filled], None] | None = None) -> RestoreResult:
        """Restore ``target``'s checkpoint, read from ``store`` (where it was written),
        else from the engine's store. For a lazy restore (``RestoreResult.lazy``),
        ``on_filled`` is called from a thread once the lazy-pages daemon has ended (every
        page in, or failed and the tree killed) and the staging dir is cleaned up; it is
        not called for a full restore."""
        began = time.monotonic()
        view = container.inspect(target.init_pid, target.bundle,
                                 cgroup_root=self._cgroup_root)
        local = self.local_dir(target)
        shutil.rmtree(local, ignore_errors=True)
        local.mkdir(parents=True)
        tally = CacheTally()
        try:
            manifest, admitted, deferred, download_ms = self._download(
                target, view, local, store, tally)
            check_images(target, local / SECTION_IMAGES, lazy=deferred is not None)
            mapped = _map_externals(manifest.restore, view)

            started = time.monotonic()
            _apply_files(admitted, local, view)
            apply_ms = _ms(started)

            started = time.monotonic()
            pid, streamed = self._run_criu(target, manifest, local, view, mapped, timeout,
                                           deferred)
            restore_ms = _ms(started)
        except BaseException:
            # Nothing downloaded stays on the node; CRIU's log is kept beside the dir.
            staging.discard(local, local / SECTION_IMAGES / RestoreRequest.log_file)
            raise
        result = RestoreResult(
            download_ms=download_ms, apply_ms=apply_ms, restore_ms=restore_ms,
            total_ms=_ms(began), restored_pid=pid,
            downloaded_bytes=manifest.totals.image_bytes, lazy=streamed is not None,
            chunks_fetched=tally.chunks, chunks_cached=tally.hits,
        )
        if streamed is None:
            # The restored tree holds nothing open in the staging dir.
            shutil.rmtree(local, ignore_errors=True)
        else:
            streamed.bulk.set()  # the tree runs: fetch the rest of its memory
            _fill_in_background(streamed, target, local,
                                _both(self._on_lazy_fill, on_filled))
        log.info("restored %s/%s into pid %d: %s", target.namespace, target.checkpoint,
                 target.init_pid, result)
        return result

    def _download(self, target: RestoreTarget, view: container.ContainerView,
                  local: Path, store: CheckpointStore | None = None,
                  tally: CacheTally | None = None,
                  ) -> tuple[Manifest, admit.Admitted, Deferred | None, int]:
        """Reads the manifest from ``store`` (where the checkpoint was written; default: the
        engine's store), admits it, then fetches and verifies the checkpoint into ``local``
        (for a lazy restore: all but the pages images, whose chunks are left to the
        returned Deferred). Returns the manifest, what to apply, the Deferred, and the
        duration in milliseconds."""
        store = store or self._store
        started = time.monotonic()
        # A sealed manifest is verified here (signature, namespace, sandbox uid, name,
        # parent, lineage): nothing is downloaded or written for one that does not verify.
        # Its stored bytes must have the digest the Checkpoint recorded, checked before
        # anything is parsed (bounded.py).
        manifest, digest = store.read_manifest(target.pin)
        check_compatible(manifest, criu_version=self._criu.version(),
                         cpu_flags=sysinfo.cpu_flags(), image_digest=target.image_digest)
        admitted = self._admit(target, manifest, view)
        check_room(manifest, admitted, local, view)
        # The manifest downloaded is the one admitted: the same bytes, by digest.
        _, deferred = store.download_deferred(
            dataclasses.replace(target.pin, digest=digest), local,
            defer=_pages_images if self.lazy else None, tally=tally)
        return manifest, admitted, deferred if self.lazy else None, _ms(started)

    @staticmethod
    def _admit(target: RestoreTarget, manifest: Manifest,
               view: container.ContainerView) -> admit.Admitted:
        """The manifest policy, against the new pod's workspace and image."""
        workspace = target.workspace_path
        admitted = admit.admit(
            manifest, workspace_path=workspace,
            workspace_mounted=workspace is not None and view.bind_source(workspace) is not None,
            image=image_lookup(view.rootfs))
        if admitted.stripped:
            log.warning(
                "restore of %s/%s: removed setuid/setgid bits and file capabilities the new "
                "container's image does not grant at the same path from %s",
                target.namespace, target.checkpoint, admit.describe_stripped(admitted.stripped))
        return admitted

    def _run_criu(self, target: RestoreTarget, manifest: Manifest, local: Path,
                  view: container.ContainerView, mapped: _Externals, timeout: float,
                  deferred: Deferred | None) -> tuple[int, lazypages.Streamed | None]:
        """Restores the tree into the container; returns its root's pid in the container,
        and for a lazy restore (``deferred``: the pages images still to fetch) what is
        still fetching and copying its memory in."""
        streamed = None if deferred is None else lazypages.start_streamed(
            self._criu.binary, local / SECTION_IMAGES, deferred)
        request = WorkerRequest(
            criu_binary=self._criu.binary,
            images_dir=str(local / SECTION_IMAGES),
            root=str(view.rootfs),
            target_pid=target.init_pid,
            externals=mapped.externals,
            netns_key=str(manifest.restore.get("netnsKey", NETNS_KEY)),
            stdio_keys=mapped.stdio_keys,
            cgroup_dirs=[str(p) for p in view.cgroup_dirs() if p.is_dir()],
            bind_self=mapped.cgroup_sources,
            lazy_pages=streamed is not None,
        )
        try:
            pid = _run_worker(request, timeout)
            _wait_for_child(target.init_pid, timeout)
        except BaseException:
            if streamed is not None:
                streamed.abort("the restore failed")
            raise
        return pid, streamed


def _pages_images(section: str, path: str) -> bool:
    """The files a lazy restore fetches while the tree already runs."""
    return section == SECTION_IMAGES and pagesource.PAGES_IMAGE.fullmatch(path) is not None


def _both(*hearers: Callable[[lazypages.Filled], None] | None
          ) -> Callable[[lazypages.Filled], None]:
    def tell(filled: lazypages.Filled) -> None:
        for hear in hearers:
            if hear is not None:
                hear(filled)
    return tell


def _fill_in_background(streamed: lazypages.Streamed, target: RestoreTarget, local: Path,
                        on_filled: Callable[[lazypages.Filled], None] | None = None) -> None:
    """Waits in a thread until the daemon has copied the tree's memory in, then removes
    the staging dir (the fetch writes and the daemon reads its pages images until then)
    and calls ``on_filled``. A daemon that fails takes the tree down with it
    (lazypages.watch)."""

    def done(filled: lazypages.Filled) -> None:
        try:
            if not filled.ok:
                streamed.deferred.stop.set()
                streamed.arrivals.fail("the lazy-pages daemon ended")
            streamed.fetcher.join()
            if filled.ok:
                # The wall clock of the last page too: what ran before it ran lazily.
                log.info("lazy restore of %s/%s: every page in after %.0f ms (unix time %.3f)",
                         target.namespace, target.checkpoint, filled.seconds * 1000,
                         time.time() - (time.monotonic() - filled.ended_at))
                shutil.rmtree(local, ignore_errors=True)
            else:
                staging.discard(local, local / SECTION_IMAGES / lazypages.LOG_FILE)
        finally:
            if on_filled is not None:
                on_filled(filled)

    lazypages.watch(streamed.daemon, tree_root=lambda: _first_child(target.init_pid),
                    timeout=LAZY_FILL_TIMEOUT_SECONDS, done=done)


def _first_child(pid: int) -> int | None:
    """Host pid of ``pid``'s first child (a restored tree's root), if it has one."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def _run_worker(request: WorkerRequest, timeout: float) -> int:
    proc = subprocess.run(
        [sys.executable, "-m", "hermit_node.engine.restore_worker"],
        input=json.dumps(asdict(request)), capture_output=True, text=True, timeout=timeout,
        check=False,
    )
    try:
        answer = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        answer = {"error": proc.stderr.strip()[-500:] or f"exit code {proc.returncode}"}
    if "error" in answer:
        raise RestoreFailed(f"restore into pid {request.target_pid} failed: {answer['error']}")
    return int(answer["pid"])


def _wait_for_child(init_pid: int, timeout: float) -> None:
    """The restored tree must end up under the container's init."""
    children = Path(f"/proc/{init_pid}/task/{init_pid}/children")
    deadline = time.monotonic() + timeout
    while not children.read_text().split():
        if time.monotonic() > deadline:
            raise RestoreFailed(f"the restored tree never became a child of pid {init_pid}")
        time.sleep(0.01)
