"""Runs ``criu restore`` from inside a new container's pid namespace and cgroups.

Started by ``restore.py`` as ``python -m hermit_node.engine.restore_worker`` (a fresh,
single-threaded interpreter, so forking is safe) with a JSON request on stdin.

The dance (docs/criu.md): join the container's pid namespace for children, fork;
the child moves itself into the container's cgroups and cgroup namespace (CRIU, in
cgroups mode ``ignore``, leaves both to its caller), takes a private mount
namespace with a fresh /proc of that pid namespace (CRIU's vDSO probe needs it),
and runs CRIU with the container's netns and stdout/stderr pipes as inherited
fds. The restored tree is a sibling of CRIU, so when the child exits the tree is
reparented to the container's PID 1 (the sandbox init), which waits for it.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hermit_node.host import nsutil
from hermit_node.host.criu import Criu, RestoreRequest


@dataclass(frozen=True)
class WorkerRequest:
    criu_binary: str
    images_dir: str
    root: str
    target_pid: int  # host pid of the new container's PID 1
    externals: list[str]  # "mnt[key]:/host/path"
    netns_key: str
    stdio_keys: dict[str, int]  # inherit key ("pipe:[N]") -> fd number of the target's PID 1
    cgroup_dirs: list[str]  # host cgroup directories of the new container
    bind_self: list[str] = field(default_factory=list)  # external sources to make mount roots
    join_uts_ipc: bool = True
    lazy_pages: bool = False  # a criu lazy-pages daemon listens in images_dir

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerRequest:
        return cls(**data)


def _child(req: WorkerRequest, netns_fd: int, cgroupns_fd: int,
           stdio_fds: dict[str, int]) -> int:
    for cgroup_dir in req.cgroup_dirs:
        # "0" is the writing process itself, whatever pid namespace it is in.
        Path(cgroup_dir, "cgroup.procs").write_text("0")
    # The container's cgroup namespace (a v2 node's containers have their own, rooted at
    # their group): what CRIU restores then reads its /proc/self/cgroup as the init does.
    nsutil.setns(cgroupns_fd, nsutil.CLONE_NEWCGROUP)
    nsutil.enter_slave_mount_namespace()
    # A restored mount whose master was outside the container (kubelet's rslave cgroup
    # mounts) copies its sharing from its external source, which must be a mount root.
    for path in req.bind_self:
        nsutil.bind_self(path)
    nsutil.mount("proc", "/proc", "proc")
    join = (("uts", "/proc/1/ns/uts"), ("ipc", "/proc/1/ns/ipc")) if req.join_uts_ipc else ()
    pid = Criu(req.criu_binary).restore(RestoreRequest(
        images_dir=Path(req.images_dir),
        root=Path(req.root),
        externals=tuple(req.externals),
        inherit_fds=((req.netns_key, netns_fd), *stdio_fds.items()),
        join_ns=join,
        lazy_pages=req.lazy_pages,
    ))
    return pid


def run(req: WorkerRequest) -> int:
    """Returns the pid of the restored root as seen inside the container's pid namespace."""
    netns_fd = os.open(f"/proc/{req.target_pid}/ns/net", os.O_RDONLY)
    pidns_fd = os.open(f"/proc/{req.target_pid}/ns/pid", os.O_RDONLY)
    cgroupns_fd = os.open(f"/proc/{req.target_pid}/ns/cgroup", os.O_RDONLY)
    stdio_fds = {
        key: os.open(f"/proc/{req.target_pid}/fd/{n}", os.O_WRONLY)
        for key, n in req.stdio_keys.items()
    }
    nsutil.setns(pidns_fd, nsutil.CLONE_NEWPID)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read_end)
        code = 0
        try:
            result: dict[str, Any] = {"pid": _child(req, netns_fd, cgroupns_fd, stdio_fds)}
        except Exception as exc:
            result = {"error": str(exc)}
            code = 1
        os.write(write_end, json.dumps(result).encode())
        os._exit(code)
    os.close(write_end)
    chunks = []
    while data := os.read(read_end, 65536):
        chunks.append(data)
    os.waitpid(child, 0)
    result = json.loads(b"".join(chunks) or b'{"error": "the restore child died"}')
    if "error" in result:
        raise RuntimeError(result["error"])
    return int(result["pid"])


if __name__ == "__main__":
    try:
        pid = run(WorkerRequest.from_dict(json.load(sys.stdin)))
    except Exception as exc:
        print(json.dumps({"error": f"{exc}"}))
        sys.exit(1)
    print(json.dumps({"pid": pid}))
