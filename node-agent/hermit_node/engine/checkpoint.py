"""Checkpoint a running container into the store: freeze, dump, capture files, upload.

The tree is frozen (cgroup freezer) while CRIU dumps memory and the writable layer
and workspace are copied, so memory and files describe one instant. A routine
checkpoint thaws right after that and uploads in the background of the workload.
A migrating checkpoint (``stop=True``) keeps the tree frozen until the manifest is
durable and only then kills it, so a failed upload leaves the sandbox running.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import logging
import os
import shutil
import termios
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hermit_common import bandwidth
from hermit_common.errors import CheckpointFailed, HermitError
from hermit_common.manifest import Binding
from hermit_common.store import (
    CheckpointStore,
    Pace,
    UploadProgress,
    UploadResult,
    UploadSession,
)
from hermit_node.engine import safecopy, staging
from hermit_node.engine.streaming import ImageStreamer
from hermit_node.host import container, freezer, locate, pagemap, sysinfo
from hermit_node.host.criu import Criu, DumpRequest

log = logging.getLogger(__name__)

NETNS_KEY = "extnet"
SECTION_IMAGES = "criu"
SECTION_ROOTFS = "rootfs"
SECTION_WORKSPACE = "workspace"
# A routine checkpoint never keeps a sandbox frozen longer than this (dump + file copy).
DEFAULT_MAX_FROZEN_SECONDS = 60.0


@dataclass(frozen=True)
class CheckpointTarget:
    namespace: str
    sandbox: str
    sandbox_uid: str
    checkpoint: str
    # Host pid of the container's PID 1 (the sandbox init). Its bundle, mounts and
    # cgroups describe the container; CRIU dumps locate.dump_root() of it.
    init_pid: int
    bundle: Path | None = None  # OCI bundle; found from the runtime shim when None
    workspace_path: str | None = "/workspace"  # mount point inside the container
    image_digest: str | None = None
    parent: str = ""  # the Checkpoint the container was restored from ("": none)


@dataclass(frozen=True)
class CheckpointResult:
    frozen_ms: int
    dump_ms: int
    capture_ms: int
    upload_ms: int
    image_bytes: int
    uploaded_bytes: int
    stored_bytes: int
    manifest_uri: str
    manifest_digest: str
    criu_version: str
    kernel: str
    cpu_flags: tuple[str, ...]
    chunks_total: int = 0  # chunk references of the manifest
    chunks_uploaded: int = 0  # chunks the store did not have yet
    lineage: tuple[str, ...] = ()  # the sandbox uid lineage a sealed manifest is signed for
    chunks_staged: int = 0  # uploaded while CRIU was still writing (streaming.py)


def restore_info(view: container.ContainerView, workspace_path: str | None,
                 mount_keys: dict[str, str],
                 cgroup_keys: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """What a restore needs to rebuild the container's wiring; stored in the manifest."""
    stdio: dict[str, int] = {}
    for fd in (1, 2):
        link = view.stdio[fd]
        if link.startswith("pipe:") and link not in stdio:
            stdio[link] = fd
    return {
        "engine": 1,
        "netnsKey": NETNS_KEY,
        "mounts": mount_keys,  # external mount key -> mount point in the container
        "cgroupMounts": cgroup_keys or {},  # external mount key -> cgroup v1 controllers
        "workspace": workspace_path if workspace_path and view.bind_source(workspace_path)
        else None,
        "stdio": stdio,  # pipe id -> fd of the container init that carries it
        "hadUpperdir": view.upperdir is not None,
    }


def external_mounts(view: container.ContainerView) -> dict[str, str]:
    """Every bind mount from the host is external: key -> mount point in the container."""
    return {f"m{i}": m.destination for i, m in enumerate(view.bind_mounts)}


def external_cgroup_mounts(view: container.ContainerView) -> dict[str, list[str]]:
    """cgroup v1 mounts are binds of the container's own groups, so external too (as runc
    does): key -> the hierarchy's controllers, to find the new container's group."""
    return {f"cg{i}": sorted(m.controllers) for i, m in enumerate(view.cgroup_mounts)}


def _copy_tree(source: Path, dest: Path) -> None:
    """Copy with owners, modes, xattrs (overlay opaque markers) and whiteout devices,
    never following a path of the tenant's tree (safecopy.py: a sidecar that swaps a
    directory for a symlink mid-copy gets a failed checkpoint, not the agent's files)."""
    stats = safecopy.copy_tree(source, dest)
    log.debug("copied %s: %d files (%d bytes), %d dirs, %d symlinks, %d hardlinks, "
              "%d special files", source, stats.files, stats.bytes, stats.dirs,
              stats.symlinks, stats.hardlinks, stats.specials)


# The runtime reads the pipes within milliseconds, unless containerd itself is slow to take
# the lines (a loaded 2-core node once needed more than 1 s). Bounded: a notice is short.
STDIO_DRAIN_SECONDS = 5.0


def wait_stdio_drained(view: container.ContainerView,
                       timeout: float = STDIO_DRAIN_SECONDS) -> None:
    """Wait (briefly) until the runtime has read what the frozen tree wrote to its
    stdout/stderr pipes. CRIU copies the data queued in a pipe into the images and puts it
    back at restore, while the runtime still reads the original: a line in flight at the
    dump would appear in the logs of both pods. The runtime is outside the frozen cgroup,
    so the pipes empty by themselves; past ``timeout`` the dump goes ahead anyway."""
    fds = []
    for n, link in ((1, view.stdio[1]), (2, view.stdio[2])):
        if link.startswith("pipe:"):
            with contextlib.suppress(OSError):
                fds.append(os.open(f"/proc/{view.init_pid}/fd/{n}",
                                   os.O_RDONLY | os.O_NONBLOCK))
    try:
        deadline = time.monotonic() + timeout
        while any(_queued(fd) for fd in fds):
            if time.monotonic() >= deadline:
                log.warning("stdout/stderr of pid %d still hold %d bytes after %.1fs; those "
                            "lines will appear again in the restored pod's log", view.init_pid,
                            sum(_queued(fd) for fd in fds), timeout)
                break
            time.sleep(0.002)
    finally:
        for fd in fds:
            os.close(fd)


def _queued(fd: int) -> int:
    """Bytes waiting in a pipe (read nothing)."""
    count = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, count)
    except OSError:
        return 0
    return count[0]


def _ms(start: float) -> int:
    return int((time.monotonic() - start) * 1000)


@dataclass(frozen=True)
class _Plan:
    """Everything decided before the tree is frozen."""

    view: container.ContainerView
    cgroup: Path
    root_pid: int  # what CRIU dumps: the init, or the tree a restore made it adopt
    local: Path
    externals: tuple[str, ...]
    restore: dict[str, Any]
    workspace_source: str | None
    binding: Binding
    store: CheckpointStore  # where the checkpoint goes


@dataclass
class _Capture:
    frozen_at: float
    dump_ms: int = 0
    capture_ms: int = 0
    sections: dict[str, Path] = field(default_factory=dict)
    thawed: bool = False
    session: UploadSession | None = None  # begun before the freeze


class CheckpointProgress(Protocol):
    """What a checkpoint tells its caller as it goes, on the checkpoint's thread (the
    node-agent writes it into the Checkpoint's status; ``CheckpointEngine.checkpoint``)."""

    def captured(self) -> None:
        """The tree's state is captured and the tree is still frozen: what is read of it
        now is what the checkpoint holds (turns read the processes' counters). Must be
        quick, as the sandbox waits, and must not raise."""

    def uploading(self, frozen_ms: int, dump_ms: int) -> None:
        """The tree's state is captured (a routine checkpoint's tree runs again): the
        upload starts."""

    def progressed(self, progress: UploadProgress) -> None:
        """A chunk is stored. Must not raise: the upload must go on."""

    def durable(self, result: CheckpointResult) -> None:
        """The manifest is in the store; a stopping checkpoint's tree is ended only after
        this returns, so this is where the checkpoint is recorded."""


class NoProgress:
    """A ``CheckpointProgress`` that is told nothing (benchmarks, tests, debugging)."""

    def captured(self) -> None:
        pass

    def uploading(self, frozen_ms: int, dump_ms: int) -> None:
        pass

    def progressed(self, progress: UploadProgress) -> None:
        pass

    def durable(self, result: CheckpointResult) -> None:
        pass


NO_PROGRESS: CheckpointProgress = NoProgress()


class CheckpointEngine:
    def __init__(self, criu: Criu, store: CheckpointStore, work_dir: Path, *,
                 max_frozen_seconds: float = DEFAULT_MAX_FROZEN_SECONDS,
                 limiter: bandwidth.UploadLimiter | None = None,
                 cgroup_root: Path = container.DEFAULT_CGROUP_ROOT) -> None:
        self._criu = criu
        self._cgroup_root = cgroup_root  # the node's cgroup filesystem
        self._store = store
        self._work_dir = work_dir
        self._max_frozen = max_frozen_seconds
        self._limiter = limiter  # the node's upload bandwidth; None: chunk PUTs never wait

    def local_dir(self, t: CheckpointTarget) -> Path:
        return self._work_dir / "checkpoints" / t.namespace / t.sandbox / t.checkpoint

    def checkpoint(self, target: CheckpointTarget, *, stop: bool = False,
                   keep_local: bool = False, deadline: float | None = None,
                   progress: CheckpointProgress = NO_PROGRESS,
                   store: CheckpointStore | None = None, urgent: bool = False,
                   ) -> CheckpointResult:
        """Take one checkpoint. ``stop=True``: the sandbox ends once it is durable (migration).

        On failure the sandbox is thawed and keeps running; CheckpointFailed says why.
        The local copy of the images is removed once the store has them, unless
        ``keep_local`` (for debugging). ``deadline`` (a ``time.monotonic()`` value, e.g.
        the node's termination time) bounds the upload; ``progress`` is told how it goes
        (``CheckpointProgress``), on this thread: ``captured()`` while the captured tree is
        still frozen, ``uploading(frozen_ms, dump_ms)`` once
        the tree's state is captured and the upload starts, ``progressed`` after each chunk
        (it must not raise), ``durable(result)`` once the manifest is in the store and,
        with ``stop``, before the old tree is killed: it records the checkpoint so nothing
        can lose it.
        ``store``: where it goes (the sandbox's own storage), else the engine's store.
        ``urgent``: its upload is a notice's (or a drain's), ahead of routine ones on the
        node's upload bandwidth from before the freeze until durable (bandwidth.py).
        """
        plan = self._plan(target, store or self._store, strict_room=not stop)
        cap = _Capture(frozen_at=time.monotonic())
        kept = False
        try:
            with self._bandwidth(urgent, (target.namespace, target.sandbox)) as pace:
                # Before the freeze: the store's chunk listing (and a sealed store's key).
                cap.session = plan.store.begin_upload(plan.binding, deadline=deadline,
                                                      parent=target.parent, pace=pace)
                freezer.freeze(plan.cgroup)
                result = self._capture_and_upload(
                    target, plan, cap, stop=stop, deadline=deadline, progress=progress)
            kept = keep_local
        except HermitError as exc:
            raise CheckpointFailed(
                f"checkpoint {target.namespace}/{target.checkpoint} failed, "
                f"sandbox left running: {exc}") from exc
        finally:
            if not cap.thawed:
                freezer.thaw(plan.cgroup)
            if not kept:  # whatever happened: nothing stays staged on the node
                shutil.rmtree(plan.local, ignore_errors=True)
        log.info("checkpoint %s/%s: frozen %d ms, dump %d ms, upload %d ms after it (%d "
                 "chunks uploaded during the dump), %d bytes stored", target.namespace,
                 target.checkpoint, result.frozen_ms, result.dump_ms, result.upload_ms,
                 result.chunks_staged, result.stored_bytes)
        return result

    @contextlib.contextmanager
    def _bandwidth(self, urgent: bool, sandbox: tuple[str, str]) -> Iterator[Pace | None]:
        """The upload's ticket on the node's bandwidth while it runs (None: no limiter);
        a routine one is promoted if its sandbox gets a stopping request meanwhile."""
        if self._limiter is None:
            yield None
            return
        with self._limiter.upload(bandwidth.URGENT if urgent else bandwidth.ROUTINE,
                                  key=sandbox) as ticket:
            yield ticket.acquire

    def _capture_and_upload(self, target: CheckpointTarget, plan: _Plan, cap: _Capture, *,
                            stop: bool, deadline: float | None,
                            progress: CheckpointProgress) -> CheckpointResult:
        """From the frozen tree to a durable checkpoint: a routine one thaws once captured,
        a stopping one ends the tree once durable (and recorded by ``progress.durable``)."""
        self._capture(plan, cap, routine=not stop)
        progress.captured()
        if not stop:
            freezer.thaw(plan.cgroup)
            cap.thawed = True
            frozen_ms = _ms(cap.frozen_at)
        progress.uploading(_ms(cap.frozen_at), cap.dump_ms)
        started = time.monotonic()
        # Page images cut where their memory is aligned: a child's copy-on-write copy of
        # its parent's pages makes the same chunks, stored once (pagemap.py).
        layouts = {SECTION_IMAGES: pagemap.image_layout(
            cap.sections[SECTION_IMAGES], plan.store.settings.chunk_size_bytes)}
        assert cap.session is not None
        uploaded = cap.session.finish(cap.sections, plan.restore, on_progress=progress.progressed,
                                      layouts=layouts)
        result = _result(plan, cap, uploaded, upload_ms=_ms(started),
                         frozen_ms=frozen_ms if not stop else _ms(cap.frozen_at))
        progress.durable(result)
        if stop:
            # Durable and recorded: end the old incarnation, every process of it killed
            # while still frozen (freezer.end_frozen).
            freezer.end_frozen(plan.cgroup, target.init_pid)
            cap.thawed = True
        return result

    def _plan(self, target: CheckpointTarget, store: CheckpointStore, *,
              strict_room: bool = True) -> _Plan:
        """Read the container and decide the dump's externals, before anything is frozen."""
        view = container.inspect(target.init_pid, target.bundle,
                                 cgroup_root=self._cgroup_root)
        cgroup = view.freezer_cgroup()
        if cgroup is None:
            raise CheckpointFailed(f"pid {target.init_pid} has no freezer cgroup")
        workspace_source = view.bind_source(target.workspace_path) \
            if target.workspace_path else None
        staging.check_checkpoint_room(
            self._work_dir, cgroup_dirs=view.cgroup_dirs(),
            trees=[(what, Path(path)) for what, path in (
                ("the writable layer", view.upperdir), ("the workspace", workspace_source))
                if path is not None], strict=strict_room)
        mount_keys = external_mounts(view)
        cgroup_points = {f"cg{i}": m.mountpoint for i, m in enumerate(view.cgroup_mounts)}
        externals = (f"net[{view.netns_inode}]:{NETNS_KEY}",
                     *(f"mnt[{dest}]:{key}" for key, dest in mount_keys.items()),
                     *(f"mnt[{point}]:{key}" for key, point in cgroup_points.items()))
        binding = Binding(
            namespace=target.namespace, sandbox=target.sandbox,
            sandbox_uid=target.sandbox_uid, checkpoint=target.checkpoint,
            criu_version=self._criu.version(), kernel=sysinfo.kernel_release(),
            cpu_flags=sysinfo.cpu_flags(), image_digest=target.image_digest,
        )
        local = self.local_dir(target)
        shutil.rmtree(local, ignore_errors=True)
        (local / SECTION_IMAGES).mkdir(parents=True)
        return _Plan(
            view=view, cgroup=cgroup, root_pid=locate.dump_root(target.init_pid), local=local,
            externals=externals,
            restore=restore_info(view, target.workspace_path, mount_keys,
                                 external_cgroup_mounts(view)),
            workspace_source=workspace_source,
            binding=binding, store=store)

    def _capture(self, plan: _Plan, cap: _Capture, *, routine: bool) -> None:
        """Dump memory and copy the writable layer and workspace while the tree is frozen.

        A routine checkpoint may keep the sandbox frozen for at most ``max_frozen_seconds``:
        past that a watchdog thaws it and the checkpoint fails (the sandbox runs on).
        """
        watchdog = threading.Timer(self._max_frozen, freezer.thaw, (plan.cgroup,)) \
            if routine else None
        if watchdog is not None:
            watchdog.daemon = True
            watchdog.start()
        try:
            wait_stdio_drained(plan.view)
            started = time.monotonic()
            images = plan.local / SECTION_IMAGES
            with self._streaming(plan, cap, images, stream=not routine):
                self._criu.dump(DumpRequest(
                    pid=plan.root_pid, images_dir=images, externals=plan.externals,
                    leave_running=True, freeze_cgroup=plan.cgroup,
                ))
                cap.dump_ms = _ms(started)
            started = time.monotonic()
            cap.sections[SECTION_IMAGES] = images
            if plan.view.upperdir is not None:
                cap.sections[SECTION_ROOTFS] = plan.local / SECTION_ROOTFS
                _copy_tree(plan.view.upperdir, cap.sections[SECTION_ROOTFS])
            if plan.workspace_source is not None:
                cap.sections[SECTION_WORKSPACE] = plan.local / SECTION_WORKSPACE
                _copy_tree(Path(plan.workspace_source), cap.sections[SECTION_WORKSPACE])
            cap.capture_ms = _ms(started)
        finally:
            if watchdog is not None:
                watchdog.cancel()
        if not freezer.is_frozen(plan.cgroup):
            why = (f"it stayed frozen longer than {self._max_frozen:g} s"
                   if routine and _ms(cap.frozen_at) >= self._max_frozen * 1000
                   else "CRIU thawed the container")
            raise CheckpointFailed(f"{why} before its files were captured")

    @staticmethod
    def _streaming(plan: _Plan, cap: _Capture, images: Path, *,
                   stream: bool) -> contextlib.AbstractContextManager[object]:
        """A migrating checkpoint uploads the page images while CRIU writes them (the
        sandbox is frozen until durable anyway); a routine one leaves CRIU both cores,
        as its frozen time is what the workload feels."""
        if not stream or cap.session is None:
            return contextlib.nullcontext()
        settings = plan.store.settings
        return ImageStreamer(cap.session, images, settings.chunk_size_bytes,
                             settings.transfer_concurrency)


def _result(plan: _Plan, cap: _Capture, uploaded: UploadResult, *, upload_ms: int,
            frozen_ms: int) -> CheckpointResult:
    return CheckpointResult(
        frozen_ms=frozen_ms, dump_ms=cap.dump_ms, capture_ms=cap.capture_ms,
        upload_ms=upload_ms, image_bytes=uploaded.image_bytes,
        uploaded_bytes=uploaded.uploaded_bytes, stored_bytes=uploaded.stored_bytes,
        manifest_uri=uploaded.manifest_uri, manifest_digest=uploaded.manifest_digest,
        criu_version=plan.binding.criu_version, kernel=plan.binding.kernel,
        cpu_flags=plan.binding.cpu_flags, chunks_total=uploaded.chunks_total,
        chunks_uploaded=uploaded.chunks_uploaded, lineage=uploaded.lineage,
        chunks_staged=uploaded.chunks_staged,
    )
