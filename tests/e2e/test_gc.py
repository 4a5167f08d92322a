"""S3 garbage collection on the cluster: 20 checkpoints with ``retain: 3`` leave exactly
the 3 kept checkpoints in the bucket.

The e2e release runs with ``nodeAgent.gc.minAgeSeconds=0`` (tests/e2e/cluster.py), so what retention
drops is collected at once. The test takes 20 Manual checkpoints of the self-checking
workload one after the other (the workload writes to its memory and workspace, so chunks
change between them), waits until retention has left 3 Checkpoints, then lists the
sandbox's prefix in the bucket: the 3 manifests, the chunks they reference (sealed: read
with the release's KEKs) and the sandbox's wrapped data key, nothing else.
"""

from __future__ import annotations

import base64
import time
import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest

from hermit_common import api
from hermit_common.seal import sealing_from
from hermit_common.settings import SealSettings, StoreSettings
from hermit_common.store import CheckpointStore
from tests.e2e import sandboxes as sb
from tests.e2e.cluster import BUCKET, RELEASE_NS, S3, E2EConfig, Kube, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

CHECKPOINTS = 20
RETAIN = 3
PREFIX = "hermit"  # the chart's s3.prefix


def _request(ns: str, sandbox: str, name: str) -> None:
    sb.custom().create_namespaced_custom_object(api.GROUP, api.VERSION, ns,
                                                api.CHECKPOINT_PLURAL, {
        "apiVersion": api.API_VERSION, "kind": api.CHECKPOINT_KIND,
        "metadata": {"name": name},
        "spec": {"sandboxRef": {"name": sandbox}, "reason": "Manual"}})


def _completed(ns: str, name: str) -> Any:
    def probe() -> Any:
        for c in sb.checkpoints(ns):
            if c["metadata"]["name"] == name:
                status = c.get("status") or {}
                assert status.get("phase") != "Failed", status.get("message")
                return c if status.get("phase") == "Completed" else None
        return None
    return probe


def _keys(s3: S3, prefix: str) -> set[str]:
    s3c = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=s3.access_key,
                       aws_secret_access_key=s3.secret_key, region_name="us-east-1")
    out: set[str] = set()
    for page in s3c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        out |= {o["Key"] for o in page.get("Contents", [])}
    return out


def _store(kube: Kube, s3: S3, keys_dir: Path) -> CheckpointStore:
    """The e2e bucket, read with the release's KEKs (the Secret the chart generated)."""
    secrets = kube.api.list_namespaced_secret(RELEASE_NS).items
    sealing = next(s for s in secrets
                   if s.metadata is not None and (s.metadata.name or "").endswith("-sealing"))
    keys_dir.mkdir()
    for key, value in (sealing.data or {}).items():
        (keys_dir / key).write_bytes(base64.b64decode(value))
    settings = StoreSettings(bucket=BUCKET, prefix=PREFIX, endpoint_url=s3.endpoint,
                             access_key_id=s3.access_key, secret_access_key=s3.secret_key)
    return CheckpointStore(settings, sealing=sealing_from(SealSettings(str(keys_dir))))


def test_twenty_checkpoints_with_retain_three_leave_three_in_the_bucket(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig, s3_for_pods: S3,
    tmp_path: Path,
) -> None:
    name, where = sb.start_on_spot(kube, e2e_config, hermit_release, namespace,
                                   checkpoint={"retain": RETAIN})
    started = time.monotonic()
    for i in range(CHECKPOINTS):
        ckpt = f"{name}-m{i:02d}-{uuid.uuid4().hex[:4]}"
        _request(namespace, name, ckpt)
        wait_until(f"checkpoint {i + 1} Completed", 120, _completed(namespace, ckpt), 0.2)
    taken = sb.since(started)

    def kept() -> list[str] | None:
        mine = sorted(c["metadata"]["name"] for c in sb.checkpoints(namespace)
                      if c["spec"]["sandboxRef"]["name"] == name)
        return mine if len(mine) == RETAIN else None

    names = wait_until(f"retention keeps {RETAIN} Checkpoints", 60, kept)
    store = _store(kube, s3_for_pods, tmp_path / "keks")
    uid = sb.sandbox(namespace, name)["metadata"]["uid"]
    expected = {store.manifest_key(namespace, name, n) for n in names}
    expected.add(store.sandbox_key_key(namespace, name, uid))
    for n in names:
        expected |= {store.chunk_key(namespace, name, c)
                     for c in store.referenced_chunks(namespace, name, n)}
    prefix = f"{PREFIX}/{namespace}/{name}/"
    seen: dict[str, set[str]] = {}

    def only_kept() -> set[str] | None:
        seen["keys"] = _keys(s3_for_pods, prefix)
        return seen["keys"] if seen["keys"] == expected else None

    try:
        listed = wait_until("the bucket to hold only the kept checkpoints", 60, only_kept)
    finally:
        extra, missing = seen.get("keys", set()) - expected, expected - seen.get("keys", set())
        print(f"\nbucket vs kept: {len(extra)} extra {sorted(extra)[:5]}, "
              f"{len(missing)} missing {sorted(missing)[:5]}")
    assert sb.status(namespace, name)["lastCheckpoint"]["name"] in names
    # The sandbox never stopped: 20 routine checkpoints, one pod.
    assert sb.wait_running(kube, namespace, name, min_ticks=1).pod == where.pod
    chunks = [k for k in listed if "/chunks/" in k]
    print(f"\ngc: {CHECKPOINTS} checkpoints in {taken:.1f}s; bucket prefix {prefix} holds "
          f"{len(listed)} objects: {RETAIN} manifests, {len(chunks)} chunks, 1 key")


def test_a_claim_on_a_stale_resource_version_is_refused(
    namespace: str, hermit_release: str, e2e_config: E2EConfig,
) -> None:
    """The node-agent's claim (its first status write) is refused by the API server once
    the Checkpoint changed since it was listed: two node-agents never both take one."""
    from hermit_node.control.kube import Kube as NodeKube
    from hermit_node.control.kube import KubeConflict

    name = f"claim-{uuid.uuid4().hex[:6]}"
    _request(namespace, "no-such-sandbox", name)
    listed: Any = sb.custom().get_namespaced_custom_object(api.GROUP, api.VERSION, namespace,
                                                      api.CHECKPOINT_PLURAL, name)
    stale = listed["metadata"]["resourceVersion"]
    sb.custom().patch_namespaced_custom_object(api.GROUP, api.VERSION, namespace,
                                               api.CHECKPOINT_PLURAL, name,
                                               {"metadata": {"labels": {"touched": "yes"}}})
    agent_kube = NodeKube.connect("e2e-test-node")
    with pytest.raises(KubeConflict):
        agent_kube.claim_checkpoint(namespace, name, {"phase": "Dumping"}, stale)
    current: Any = sb.custom().get_namespaced_custom_object(api.GROUP, api.VERSION, namespace,
                                                       api.CHECKPOINT_PLURAL, name)
    assert (current.get("status") or {}).get("phase") != "Dumping"
    print(f"\nclaim on resourceVersion {stale} refused after the Checkpoint changed to "
          f"{current['metadata']['resourceVersion']}")
