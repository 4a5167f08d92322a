"""Forks fanning out: one checkpoint restored into several containers of one node at once.

Each restore stages its files in a directory of its own (RestoreEngine.local_dir, keyed by
the new container): restores of the same checkpoint share nothing mutable. Before, they
shared ``restores/<ns>/<sandbox>/<checkpoint>/`` and removed each other's files
(issue 20: six forks of one Manual checkpoint failed with ``FileNotFoundError
criu/pages-3.img``). Real CRIU, containerd, runc, CNI and MinIO.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hermit_common.pin import Pin
from hermit_common.settings import StoreSettings
from hermit_common.store import CheckpointStore
from hermit_node.engine.checkpoint import CheckpointEngine, CheckpointTarget
from hermit_node.engine.restore import RestoreEngine, RestoreResult, RestoreTarget
from hermit_node.host.criu import Criu
from hermit_testbed.cni import CniNetwork
from hermit_testbed.errors import TestbedError
from hermit_testbed.scenario import (
    Node,
    Sandbox,
    build_sandbox_image,
    destroy_sandbox,
    start_sandbox,
)
from tests.support.containerd import require_containerd, two_nodes
from tests.support.minio import MinioServer

pytestmark = pytest.mark.integration

NAMESPACE = "agents"
FORKS = 3


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Node, Node]]:
    require_containerd()
    base = tmp_path_factory.mktemp("fanout")
    try:
        image_tar = build_sandbox_image(base)
    except TestbedError as exc:
        pytest.fail(str(exc), pytrace=False)
    with two_nodes(base, image_tar) as pair:
        yield pair


def test_one_checkpoint_restores_into_several_containers_of_a_node_at_once(
    nodes: tuple[Node, Node], cni_network: CniNetwork, criu_bin: Path,
    minio_server: MinioServer,
) -> None:
    node_a, node_b = nodes
    settings: StoreSettings = minio_server.settings(f"fanout-{uuid.uuid4().hex[:8]}")
    store = CheckpointStore(settings)
    store.ensure_bucket()
    criu = Criu(str(criu_bin))
    uid = str(uuid.uuid4())

    source = start_sandbox(node_a, cni_network, "sbx")
    try:
        source.wait_ticks(5)
        CheckpointEngine(criu, store, node_a.work_dir).checkpoint(CheckpointTarget(
            namespace=NAMESPACE, sandbox="sbx", sandbox_uid=uid, checkpoint="manual-1",
            init_pid=source.init_pid, image_digest=node_a.image_digest()), stop=True)
        source.container.wait_exit(30)
        last = source.ticks()[-1]
    finally:
        destroy_sandbox(source, cni_network)

    engine = RestoreEngine(criu, store, node_b.work_dir)  # one per node, as in the agent
    forks: list[Sandbox] = []
    results: dict[int, RestoreResult | BaseException] = {}
    try:
        for i in range(FORKS):
            forks.append(start_sandbox(node_b, cni_network, f"fork-{i}", restore=True))
        targets = [RestoreTarget(pin=Pin(NAMESPACE, "sbx", "manual-1", uid=uid),
                                 init_pid=fork.init_pid, image_digest=node_b.image_digest())
                   for fork in forks]
        assert len({engine.local_dir(t) for t in targets}) == FORKS
        start = threading.Barrier(FORKS)

        def restore(i: int) -> None:
            start.wait(30)
            try:
                results[i] = engine.restore(targets[i])
            except BaseException as exc:  # reported below, per fork
                results[i] = exc

        threads = [threading.Thread(target=restore, args=(i,)) for i in range(FORKS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(180)
        failed = {i: r for i, r in results.items() if isinstance(r, BaseException)}
        assert not failed and len(results) == FORKS, f"restores failed: {failed}"
        for i, fork in enumerate(forks):
            # Each fork continues the counter from the checkpoint: no gap, no duplicate.
            ticks = fork.wait_ticks(last + 5)
            assert ticks == list(range(1, len(ticks) + 1)), f"fork {i}: gap or duplicate"
            assert fork.container.alive(), fork.container.read_log()[-500:]
            assert not engine.local_dir(targets[i]).exists(), "staging dir left behind"
        print(f"\nFANOUT {FORKS} restores of one checkpoint at once on one node: "
              + ", ".join(f"{r.total_ms} ms" for r in results.values()
                          if isinstance(r, RestoreResult)))
    finally:
        for fork in forks:
            destroy_sandbox(fork, cni_network)
