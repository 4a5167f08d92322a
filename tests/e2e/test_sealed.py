"""Sealed checkpoints on the cluster: a preempted sandbox moves, and the bucket holds
nothing of it in the clear.

The chart seals by default with the KEK Secret it generates (nodeAgent.sealing). The
self-checking workload gets a marker string in its environment (so in its process
memory, which CRIU dumps) and in a workspace file; after a preemption and a restore
that continues the counter, no object of the sandbox's namespace in the e2e bucket
shows the marker, neither as stored nor after an attempted zstd decompression.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import boto3
import pytest
import zstandard
from kubernetes import client
from kubernetes.stream import stream

from tests.e2e import sandboxes as sb
from tests.e2e.conftest import (
    BUCKET,
    RELEASE_NS,
    S3,
    E2EConfig,
    Kube,
    run_cluster_command,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NOTICE_SECONDS = 20
MARKER = "HERMIT-E2E-SEAL-MARKER-" + uuid.uuid4().hex
MARKER_FILE = "/workspace/sealed-marker.txt"


def _exec(ns: str, pod: str, script: str) -> str:
    return str(stream(client.CoreV1Api().connect_get_namespaced_pod_exec, pod, ns,
                      command=["sh", "-c", script], stderr=True, stdin=False, stdout=True,
                      tty=False))


def _start_with_marker(kube: Kube, cfg: E2EConfig, ns: str) -> tuple[str, sb.Running]:
    sb.ensure_spot_nodes(kube, cfg, 2)
    name = f"agent-{uuid.uuid4().hex[:6]}"
    spec = sb.stateful_spec(cfg.sandbox_image)
    spec["podTemplate"]["spec"]["containers"][0]["env"].append(
        {"name": "HERMIT_E2E_MARKER", "value": MARKER})
    sb.create_sandbox(ns, name, spec)
    where = sb.wait_running(kube, ns, name, min_ticks=5)
    _exec(ns, where.pod, f"echo {MARKER} > {MARKER_FILE}")
    assert MARKER in _exec(ns, where.pod, f"cat {MARKER_FILE}")
    sb.wait_agent_ready(kube, RELEASE_NS, where.node)
    return name, where


def _objects(s3: S3, ns: str) -> dict[str, bytes]:
    """Every object of namespace ``ns`` in the e2e bucket, as stored."""
    s3c = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=s3.access_key,
                       aws_secret_access_key=s3.secret_key, region_name="us-east-1")
    out = {}
    for page in s3c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        for obj in page.get("Contents", []):
            if f"/{ns}/" in f"/{obj['Key']}":
                out[obj["Key"]] = s3c.get_object(Bucket=BUCKET, Key=obj["Key"])["Body"].read()
    return out


def _shows(data: bytes, needle: bytes) -> bool:
    if needle in data:
        return True
    try:
        return needle in zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 28)
    except zstandard.ZstdError:
        return False


def test_preempted_sandbox_is_sealed_in_the_bucket(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig, s3_for_pods: S3,
) -> None:
    name, where = _start_with_marker(kube, e2e_config, namespace)
    started = time.monotonic()
    preempt = run_cluster_command(e2e_config.preempt_cmd, node=where.node,
                                  notice=str(NOTICE_SECONDS))
    try:
        ckpt: dict[str, Any] = wait_until(
            "a Completed Preemption checkpoint", NOTICE_SECONDS + 30,
            sb.completed_checkpoint(namespace, "Preemption", sandbox_name=name), 0.2)
        last = sb.ticks(kube, namespace, where.pod)
        after = sb.wait_running(kube, namespace, name, restores=where.restores + 1,
                                avoid=where.node, timeout=180, min_ticks=1)
        sb.assert_continues(kube, namespace, after.pod, last[-1] if last else 0,
                            exact=bool(last))
    finally:
        out, _ = preempt.communicate(timeout=NOTICE_SECONDS + 180)
    assert preempt.returncode == 0, f"preempt command failed: {out}"
    # The marker went through the store: the restored pod has it in its workspace and
    # in its environment.
    assert MARKER in _exec(namespace, after.pod, f"cat {MARKER_FILE}")
    assert MARKER in _exec(namespace, after.pod,
                           "cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'")

    objects = _objects(s3_for_pods, namespace)
    manifests = [k for k in objects if k.endswith("/manifest.json")]
    chunks = [k for k in objects if "/chunks/" in k]
    assert manifests and len(chunks) >= 5, sorted(objects)
    for key in manifests:
        assert objects[key].startswith(b'{"ciphertext":'), f"{key} is not a sealed envelope"
    leaks = [k for k, data in objects.items() if _shows(data, MARKER.encode())]
    assert leaks == [], f"the marker is readable in {leaks}"
    status = ckpt.get("status") or {}
    assert not {"kek", "dek"} & set(status) and MARKER not in str(status)
    print(f"\nsealed: {len(objects)} objects of {namespace} ({len(chunks)} chunks), "
          f"no marker; preemption to running {sb.since(started):.1f}s")
