"""CRIU through pycriu's RPC: typed requests in, ``criu swrk`` out; the only module that
imports pycriu (image decoding included).

pycriu forks ``criu swrk`` from the calling process, so namespace and cgroup
placement of the caller decide where a restored tree lands: a restore calls this module
from restore_worker, a child process that first moves into the new container.
lazypages runs the criu binary itself (``criu check``, the ``criu lazy-pages`` daemon).
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hermit_common.errors import CheckpointRefused, HermitError
from hermit_node.host import pagemap


class CriuError(HermitError):
    """CRIU refused or failed; the message carries the first error lines of its log."""


@dataclass(frozen=True)
class DumpRequest:
    pid: int
    images_dir: Path
    externals: tuple[str, ...] = ()  # e.g. "net[4026532008]:extnet", "mnt[/workspace]:m0"
    leave_running: bool = True
    freeze_cgroup: Path | None = None
    log_file: str = "dump.log"
    log_level: int = 4
    tcp_established: bool = True
    file_locks: bool = True
    timeout_seconds: int = 0  # 0: CRIU's default


@dataclass(frozen=True)
class RestoreRequest:
    images_dir: Path
    root: Path
    externals: tuple[str, ...] = ()  # e.g. "mnt[m0]:/host/path/of/new/volume"
    inherit_fds: tuple[tuple[str, int], ...] = ()  # (key, fd open in this process)
    join_ns: tuple[tuple[str, str], ...] = ()  # (ns, path)
    log_file: str = "restore.log"
    log_level: int = 4
    tcp_close: bool = True
    file_locks: bool = True
    rst_sibling: bool = True
    # Leave anonymous private memory to a running ``criu lazy-pages`` daemon (lazypages.py)
    # listening in the images dir.
    lazy_pages: bool = False


@dataclass
class Criu:
    """A CRIU binary; every call forks a fresh ``criu swrk`` through pycriu."""

    binary: str = "criu"
    _version: str | None = field(default=None, init=False, repr=False)

    def version(self) -> str:
        if self._version is None:
            try:
                out = subprocess.run(
                    [self.binary, "--version"], capture_output=True, text=True, check=True,
                    timeout=10,
                ).stdout
            except (OSError, subprocess.SubprocessError) as exc:
                raise CriuError(f"cannot run {self.binary} --version: {exc}") from exc
            match = re.search(r"Version:\s*(\S+)", out)
            if not match:
                raise CriuError(f"cannot parse the CRIU version from {out!r}")
            self._version = match.group(1)
        return self._version

    def _client(self) -> Any:
        import pycriu  # the one import of pycriu in the project

        client = pycriu.criu()
        client.use_binary(self.binary)
        return client

    def dump(self, req: DumpRequest) -> None:
        import pycriu

        rpc = pycriu.rpc
        client = self._client()
        images_fd = os.open(req.images_dir, os.O_DIRECTORY)
        try:
            opts = client.opts
            opts.images_dir_fd = images_fd
            opts.pid = req.pid
            opts.leave_running = req.leave_running
            opts.log_file = req.log_file
            opts.log_level = req.log_level
            opts.tcp_established = req.tcp_established
            opts.file_locks = req.file_locks
            opts.shell_job = False
            opts.manage_cgroups = True
            opts.manage_cgroups_mode = rpc.IGNORE
            _skip_network_lock(opts, rpc)
            if req.freeze_cgroup is not None:
                opts.freeze_cgroup = str(req.freeze_cgroup)
            if req.timeout_seconds:
                opts.timeout = req.timeout_seconds
            # Kubelet bind mounts are slaves of host mounts (rslave); their masters live
            # outside the container and are recreated by the new container's runtime.
            opts.ext_masters = True
            opts.ext_sharing = True
            opts.external.extend(req.externals)
            os.set_inheritable(images_fd, True)
            try:
                client.dump()
            except pycriu.CRIUException as exc:
                raise CriuError(f"criu dump of pid {req.pid} failed: "
                                f"{log_errors(req.images_dir / req.log_file) or exc}") from exc
        finally:
            os.close(images_fd)

    def restore(self, req: RestoreRequest) -> int:
        """Restore the tree; returns the pid of its root as seen by the caller."""
        import pycriu

        rpc = pycriu.rpc
        client = self._client()
        images_fd = os.open(req.images_dir, os.O_DIRECTORY)
        try:
            os.set_inheritable(images_fd, True)
            opts = client.opts
            opts.images_dir_fd = images_fd
            opts.root = str(req.root)
            opts.log_file = req.log_file
            opts.log_level = req.log_level
            opts.tcp_close = req.tcp_close
            opts.file_locks = req.file_locks
            opts.shell_job = False
            opts.rst_sibling = req.rst_sibling
            if req.lazy_pages:
                opts.lazy_pages = True
            opts.manage_cgroups = True
            opts.manage_cgroups_mode = rpc.IGNORE
            _skip_network_lock(opts, rpc)
            opts.ext_masters = True
            opts.ext_sharing = True
            opts.external.extend(req.externals)
            for key, fd in req.inherit_fds:
                os.set_inheritable(fd, True)
                item = opts.inherit_fd.add()
                item.key = key
                item.fd = fd
            for ns, path in req.join_ns:
                item = opts.join_ns.add()
                item.ns = ns
                item.ns_file = path
            try:
                resp = client.restore()
            except pycriu.CRIUException as exc:
                raise CriuError("criu restore failed: "
                                f"{log_errors(req.images_dir / req.log_file) or exc}") from exc
            return int(resp.pid)
        finally:
            os.close(images_fd)


@dataclass(frozen=True)
class PageMap:
    """One task's ``pagemap-<pid>.img``: which pages image holds its memory, and its
    entries in file order as (vaddr, nr_pages, flags) (flags: CRIU's PE_* bits)."""

    pid: int
    pages_id: int
    entries: tuple[tuple[int, int, int], ...]


PAGEMAP_FILE = re.compile(r"pagemap-(\d+)\.img")


def read_pagemaps(images_dir: Path) -> list[PageMap]:
    """The task pagemaps of an images dir (shared-memory pagemaps are not included).
    Each is size-bounded before it is parsed (pagemap.MAX_PAGEMAP_BYTES); one too large
    or malformed refuses the checkpoint."""
    maps = []
    for path in sorted(images_dir.iterdir()):
        match = PAGEMAP_FILE.fullmatch(path.name)
        if match is None:
            continue
        raw = read_image_bytes(path, pagemap.MAX_PAGEMAP_BYTES)
        try:
            pages_id, entries = pagemap.pagemap_entries(raw)
        except pagemap.PagemapError as exc:
            raise CheckpointRefused(f"CRIU image {path.name} cannot be parsed: {exc}") from None
        maps.append(PageMap(pid=int(match.group(1)), pages_id=pages_id,
                            entries=tuple(entries)))
    return maps


def read_image_bytes(path: Path, max_bytes: int) -> bytes:
    """The bytes of a CRIU image of a checkpoint (untrusted: from the store), refused
    before anything parses them when the file is not a regular file or holds more
    than ``max_bytes`` (each caller's bound says why it is generous)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise CheckpointRefused(f"CRIU image {path.name} cannot be opened: {exc}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointRefused(f"CRIU image {path.name} is not a regular file")
        data = f.read(max_bytes + 1) if st.st_size <= max_bytes else b""
    if st.st_size > max_bytes or len(data) > max_bytes:
        raise CheckpointRefused(
            f"CRIU image {path.name} is {max(st.st_size, len(data))} bytes, more than the "
            f"{max_bytes} a restore parses")
    return data


def load_image(path: Path, max_bytes: int) -> dict[str, Any]:
    """A CRIU image decoded by pycriu ({"magic", "entries"}), size-bounded first
    (read_image_bytes); one that does not decode refuses the checkpoint."""
    raw = read_image_bytes(path, max_bytes)  # before pycriu sees a byte
    import pycriu.images

    try:
        image = pycriu.images.loads(raw)
    except Exception as exc:  # pycriu raises anything on a corrupt image
        raise CheckpointRefused(
            f"CRIU image {path.name} cannot be parsed: {type(exc).__name__}: "
            f"{str(exc)[:200]}") from None
    if not isinstance(image, dict) or not isinstance(image.get("entries"), list):
        raise CheckpointRefused(f"CRIU image {path.name} cannot be parsed")
    return image


def save_image(path: Path, image: dict[str, Any]) -> None:
    """Writes ``image`` (as ``load_image`` gives it) to ``path``: a new file renamed over
    the old, so another link to the old file keeps its bytes."""
    import pycriu.images

    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(pycriu.images.dumps(image))
    os.replace(tmp, path)


def _skip_network_lock(opts: Any, rpc: Any) -> None:
    # Locking needs iptables/nftables inside the netns; the sandbox's netns is external
    # and its pod is about to go away, so there is nothing to protect.
    if hasattr(rpc, "SKIP") and "network_lock" in opts.DESCRIPTOR.fields_by_name:
        opts.network_lock = rpc.SKIP


def log_errors(log_path: Path, limit: int = 3) -> str:
    """The first few error lines of a CRIU log, joined into one line."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [ln.split(": ", 1)[-1].strip() for ln in lines if "Error" in ln or "error" in ln]
    return "; ".join(errors[:limit])
