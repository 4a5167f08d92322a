"""The node-agent's watches against a real kube-apiserver (a throwaway control plane): only
its node's pods, Checkpoints and Node reach its copy; changes and deletes arrive as they
happen; a resourceVersion the server no longer has answers 410 Gone, and the informer
lists again."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from hermit_common import api, protocol
from hermit_node.control.informer import GONE, Informer, WatchedNode
from hermit_node.control.kube import Kube, KubeError
from tests.support.controlplane import ControlPlane, control_plane
from tests.support.wait import wait_until

__all__ = ["control_plane"]

NS = "watch"


@pytest.fixture(scope="module")
def apis(control_plane: ControlPlane) -> Iterator[tuple[client.CoreV1Api, Any, Kube]]:
    from hermit_common.kubeclient import load_configuration

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KUBECONFIG", str(control_plane.kubeconfig))
        cfg = load_configuration()
    api_client = client.ApiClient(cfg)
    ext = client.ApiextensionsV1Api(api_client)
    for path in sorted((Path(__file__).resolve().parents[2] / "crds").glob("*.yaml")):
        ext.create_custom_resource_definition(yaml.safe_load(path.read_text()))
    core, custom = client.CoreV1Api(api_client), client.CustomObjectsApi(api_client)
    core.create_namespace({"metadata": {"name": NS}})
    # No controller-manager runs: the pods' ServiceAccount is made here.
    core.create_namespaced_service_account(NS, {"metadata": {"name": "default"}})
    for node in ("node-a", "node-b"):
        core.create_node({"metadata": {"name": node}})
    wait_until("the Checkpoint CRD", 20.0, lambda: _served(custom), 0.05)
    yield core, custom, Kube(api_client, "node-a")


def _served(custom: Any) -> bool:
    try:
        custom.list_cluster_custom_object(api.GROUP, api.VERSION, api.CHECKPOINT_PLURAL)
        return True
    except client.ApiException:
        return False


def _names(objs: list[dict[str, Any]]) -> list[str]:
    return sorted(protocol.name_of(o) for o in objs)


def test_the_copy_holds_only_this_nodes_objects_and_follows_them(
        apis: tuple[client.CoreV1Api, Any, Kube]) -> None:
    core, custom, kube = apis
    stop = threading.Event()
    view = WatchedNode(kube, stop)
    view.start(30.0)
    try:
        assert view.healthy() and protocol.name_of(view.node_now() or {}) == "node-a"
        for node in ("node-a", "node-b"):
            custom.create_namespaced_custom_object(
                api.GROUP, api.VERSION, NS, api.CHECKPOINT_PLURAL,
                protocol.checkpoint_object("box", f"box-{node}", protocol.MANUAL, 1, node=node))
            core.create_namespaced_pod(NS, {"metadata": {"name": f"p-{node}"}, "spec": {
                "nodeName": node, "containers": [{"name": "c", "image": "x"}]}})
        core.patch_node("node-a", {"spec": {"unschedulable": True}})
        wait_until("the events", 20.0, lambda: _names(view.checkpoints_now()) == ["box-node-a"]
                   and _names(view.pods_now()) == ["p-node-a"]
                   and bool(((view.node_now() or {}).get("spec") or {}).get("unschedulable")), 0.05)
        custom.delete_namespaced_custom_object(api.GROUP, api.VERSION, NS,
                                               api.CHECKPOINT_PLURAL, "box-node-a")
        wait_until("the delete", 20.0, lambda: view.checkpoints_now() == [], 0.05)
        assert view.healthy()
    finally:
        stop.set()


class Counted:
    """A ListWatch that counts its lists."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.what, self.lists = inner, inner.what, 0

    def list(self) -> tuple[list[dict[str, Any]], str]:
        self.lists += 1
        return self.inner.list()  # type: ignore[no-any-return]

    def watch(self, resource_version: str, timeout_seconds: int) -> Any:
        return self.inner.watch(resource_version, timeout_seconds)


def test_an_old_resource_version_is_gone_and_the_informer_lists_again(
        apis: tuple[client.CoreV1Api, Any, Kube]) -> None:
    _, custom, kube = apis
    with pytest.raises(KubeError) as gone:
        list(kube.node_checkpoints().watch("1", 5))
    assert gone.value.status == GONE
    source = Counted(kube.node_checkpoints())
    stop = threading.Event()
    inf = Informer(source, lambda: None, stop, watch_seconds=1)  # short watches
    inf._thread.start()
    try:
        wait_until("the first list", 20.0, lambda: inf.synced, 0.05)
        custom.create_namespaced_custom_object(
            api.GROUP, api.VERSION, NS, api.CHECKPOINT_PLURAL,
            protocol.checkpoint_object("box", "box-late", protocol.MANUAL, 1, node="node-a"))
        wait_until("its event", 20.0, lambda: "box-late" in _names(inf.snapshot()), 0.05)
        assert source.lists == 1
        with inf._lock:
            inf._store.resource_version = "1"  # as if the watch had fallen far behind
        wait_until("the list after 410 Gone", 20.0, lambda: source.lists == 2, 0.05)
        wait_until("a healthy watch again", 20.0, lambda: inf.healthy, 0.05)
        assert "box-late" in _names(inf.snapshot())
    finally:
        stop.set()
