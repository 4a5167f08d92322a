"""A tiny node for tests, demos and benchmarks: real containerd + runc + CNI, no Kubernetes.

with Containerd(base / "cd") as cd, CniNetwork(base / "cni") as net:
    ref = cd.import_image(build_image(busybox_rootfs(base / "rootfs"), REF, base / "i.tar"))
    c = cd.run("c1", ref, ["sh", "-c", "..."], mounts=[Mount(ws, "/workspace")],
               netns_path=net.add("c1").path)
"""

from __future__ import annotations

from hermit_testbed.cni import CniNetwork, Netns
from hermit_testbed.container import Container, Mount
from hermit_testbed.containerd import Containerd
from hermit_testbed.errors import TestbedError
from hermit_testbed.image import build_image, busybox_rootfs, image_digest

__all__ = [
    "CniNetwork",
    "Container",
    "Containerd",
    "Mount",
    "Netns",
    "TestbedError",
    "build_image",
    "busybox_rootfs",
    "image_digest",
]
