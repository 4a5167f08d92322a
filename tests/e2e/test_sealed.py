"""Sealed checkpoints on the cluster: a preempted sandbox moves, and the bucket holds
nothing of it in the clear; tampered, foreign and swapped checkpoints are refused before
CRIU runs, a setuid file the image lacks is stripped, and a fork dedups with its source.

The chart seals by default with the KEK Secret it generates (nodeAgent.sealing). The
self-checking workload gets a marker string in its environment (so in its process
memory, which CRIU dumps) and in a workspace file; after a preemption and a restore
that continues the counter, no object of the sandbox's namespace in the e2e bucket
shows the marker, neither as stored nor after an attempted zstd decompression.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest
import zstandard
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hermit_common import api, protocol
from hermit_common.manifest import Binding
from hermit_common.settings import StoreSettings
from hermit_common.store import CheckpointStore
from tests.e2e import sandboxes as sb
from tests.e2e.cluster import (
    BUCKET,
    RELEASE_NS,
    S3,
    E2EConfig,
    Kube,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NOTICE_SECONDS = 20
MARKER = "HERMIT-E2E-SEAL-MARKER-" + uuid.uuid4().hex
MARKER_FILE = "/workspace/sealed-marker.txt"


def _start_with_marker(kube: Kube, cfg: E2EConfig, ns: str) -> tuple[str, sb.Running]:
    sb.ensure_spot_nodes(kube, cfg, 2)
    name = f"agent-{uuid.uuid4().hex[:6]}"
    spec = sb.stateful_spec(cfg.sandbox_image)
    spec["podTemplate"]["spec"]["containers"][0]["env"].append(
        {"name": "HERMIT_E2E_MARKER", "value": MARKER})
    sb.create_sandbox(ns, name, spec)
    where = sb.wait_running(kube, ns, name, min_ticks=5)
    sb.exec_sh(ns, where.pod, f"echo {MARKER} > {MARKER_FILE}")
    assert MARKER in sb.exec_sh(ns, where.pod, f"cat {MARKER_FILE}")
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


def _assert_the_scan_finds_the_marker_unsealed(s3: S3, ns: str, work: Path) -> None:
    """A checkpoint holding the marker as the sealed one does (a workspace file, and the
    workload's environment amid its memory pages), written with the project's own store
    with sealing off to the same bucket, under namespace ``ns`` (no sandbox's): the scan
    of the sealed objects must find the marker there, stored or zstd-compressed. Its
    objects are deleted afterwards."""
    images, workspace = work / "criu", work / "workspace"
    images.mkdir()
    workspace.mkdir()
    (workspace / Path(MARKER_FILE).name).write_text(f"{MARKER}\n")
    environ = f"PATH=/bin\0HERMIT_E2E_MARKER={MARKER}\0HERMIT_TICK_MS={sb.TICK_MS}\0"
    page = 4096
    (images / "pages-1.img").write_bytes(
        bytes(range(256)) * (4 * page // 256) + environ.encode().ljust(page, b"\0")
        + os.urandom(4 * page))
    store = CheckpointStore(StoreSettings(bucket=BUCKET, endpoint_url=s3.endpoint,
                                          access_key_id=s3.access_key,
                                          secret_access_key=s3.secret_key), sealing=None)
    binding = Binding(namespace=ns, sandbox="plain", sandbox_uid=str(uuid.uuid4()),
                      checkpoint="plain-1", criu_version="control", kernel="control")
    store.upload(binding, {"criu": images, "workspace": workspace}, {})
    objects = _objects(s3, ns)
    s3c = _s3c(s3)
    for key in objects:
        s3c.delete_object(Bucket=BUCKET, Key=key)
    chunks = [k for k in objects if "/chunks/" in k]
    manifests = [k for k in objects if k.endswith("/manifest.json")]
    assert manifests and chunks, sorted(objects)
    assert not any(objects[k].startswith(b'{"ciphertext":') for k in manifests)
    # Both chunks that hold it: the workspace file's and the memory image's.
    found = [k for k in chunks if _shows(objects[k], MARKER.encode())]
    assert len(found) >= 2, (f"the scan finds the marker in {found} of the unsealed "
                             f"chunks {chunks}: it could miss it in the sealed ones too")
    print(f"\ncontrol: the scan finds the marker in {len(found)} of {len(chunks)} chunks of "
          f"the same content stored unsealed")


def test_preempted_sandbox_is_sealed_in_the_bucket(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig, s3_for_pods: S3,
    tmp_path: Path,
) -> None:
    name, where = _start_with_marker(kube, e2e_config, namespace)
    started = time.monotonic()
    with sb.preempting(e2e_config, where.node, NOTICE_SECONDS):
        old = sb.LastTick(kube, namespace, where.pod)
        ckpt = sb.durable_reading(
            "a Completed Preemption checkpoint", NOTICE_SECONDS + 30,
            sb.completed_checkpoint(namespace, "Preemption", sandbox_name=name), [old])
        last = old.final()
        after = sb.wait_running(kube, namespace, name, restores=where.restores + 1,
                                avoid=where.node, timeout=180, min_ticks=1)
        sb.assert_continues(kube, namespace, after.pod, last, exact=True)
    # The marker went through the store: the restored pod has it in its workspace and
    # in its environment.
    assert MARKER in sb.exec_sh(namespace, after.pod, f"cat {MARKER_FILE}")
    assert MARKER in sb.exec_sh(namespace, after.pod,
                           "cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'")

    # The scan's positive control first: it finds the marker in a checkpoint written
    # with sealing off, so its finding nothing below means the objects hide it.
    _assert_the_scan_finds_the_marker_unsealed(s3_for_pods, f"{namespace[:50]}-plain",
                                               tmp_path)
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


# -- refused before CRIU runs: a flipped byte, a foreign namespace, a swapped manifest; a
# setuid file the image does not have is stripped ---------------------------------------

# In /tmp: the sandbox runs as the restricted pod policy's default user (65532), who may
# create a setuid file of its own there (the image's / is root's).
SUID = "/tmp/e2e-suid"
BUSYBOX = "/bin/busybox"


def _s3c(s3: S3) -> Any:
    return boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=s3.access_key,
                        aws_secret_access_key=s3.secret_key, region_name="us-east-1")


def _manifest_key(ckpt: dict[str, Any]) -> str:
    uri = str(ckpt["status"]["manifestURI"])
    assert uri.startswith(f"s3://{BUCKET}/"), uri
    return uri[len(f"s3://{BUCKET}/"):]


def _flip_a_byte(s3c: Any, key: str) -> None:
    raw = bytearray(s3c.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    at = raw.index(b'"ciphertext":"') + 40
    raw[at] = ord("A") if raw[at] != ord("A") else ord("B")  # still base64
    s3c.put_object(Bucket=BUCKET, Key=key, Body=bytes(raw))


def _copy_to_namespace(s3c: Any, ckpt: dict[str, Any], source_ns: str, ns: str) -> None:
    """What someone with the bucket and `create` on Checkpoints in ``ns`` can do: copy a
    checkpoint's objects and its Checkpoint (status included) there. The verified mark is
    refused to anyone but the operator (the checkpoint-trust admission policy): the copy
    carries it here only as the operator's service account would set it, so that what a
    restore checks of the sealed context is shown too (a compromised operator, or a cluster
    whose policy is off)."""
    sandbox = ckpt["spec"]["sandboxRef"]["name"]
    top = _manifest_key(ckpt).split(f"/{source_ns}/{sandbox}/")[0]
    old, new = f"{top}/{source_ns}/{sandbox}/", f"{top}/{ns}/{sandbox}/"
    for page in s3c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=old):
        for obj in page.get("Contents", []):
            s3c.copy_object(Bucket=BUCKET, Key=new + obj["Key"][len(old):],
                            CopySource={"Bucket": BUCKET, "Key": obj["Key"]})
    meta = ckpt["metadata"]
    name = meta["name"]
    body = {"apiVersion": api.API_VERSION, "kind": api.CHECKPOINT_KIND,
            "metadata": {"name": name, "labels": meta.get("labels") or {},
                         "annotations": {protocol.ANNOTATION_NODE_VERIFIED: "true"}},
            "spec": ckpt["spec"]}
    try:
        sb.custom().create_namespaced_custom_object(
            api.GROUP, api.VERSION, ns, api.CHECKPOINT_PLURAL, body)
        raise AssertionError("a Checkpoint marked verified was admitted from the test's user")
    except ApiException as exc:
        assert exc.status == 422 and "may mark a Checkpoint" in str(exc.body), exc
    operator = client.ApiClient()
    operator.set_default_header(
        "Impersonate-User", f"system:serviceaccount:{RELEASE_NS}:{RELEASE_NS}-operator")
    client.CustomObjectsApi(operator).create_namespaced_custom_object(
        api.GROUP, api.VERSION, ns, api.CHECKPOINT_PLURAL, body)
    sb.custom().patch_namespaced_custom_object_status(
        api.GROUP, api.VERSION, ns, api.CHECKPOINT_PLURAL, name, {"status": ckpt["status"]})


def _refused(kube: Kube, ns: str, sandbox: str, source: str, says: str) -> str:
    """The sandbox restoring ``source`` was refused (its restore pod's node-agent said so,
    before CRIU) and starts from scratch: the Warning's message, which quotes the refusal."""
    def warned() -> str | None:
        for e in sb.events(kube, ns, sandbox):
            if e["reason"] == api.REASON_NO_USABLE_CHECKPOINT and source in e["message"]:
                return str(e["message"])
        return None

    message = wait_until(f"{sandbox}: restore of {source} refused", 120, warned, 0.5)
    assert f"checkpoint {ns}/{source} is refused: " in message and says in message, message
    assert int(sb.status(ns, sandbox).get("restores") or 0) == 0
    print(f"  {sandbox}: {message}")
    return message


def _fork(cfg: E2EConfig, ns: str, name: str, source: str) -> str:
    sb.create_sandbox(ns, name, sb.stateful_spec(cfg.sandbox_image, restoreFrom=source))
    return name


def _setuid_stripped(kube: Kube, ns: str, fork: str, source: str) -> sb.Running:
    """The fork of a checkpoint holding a setuid file the image lacks runs without the bit;
    its node-agent removed it before CRIU restored the tree."""
    forked = sb.wait_running(kube, ns, fork, restores=1, min_ticks=1)
    mode = sb.exec_sh(ns, forked.pod, f"{BUSYBOX} stat -c %a {SUID}").strip()
    assert mode == "755", f"{SUID} has mode {mode} after the restore"
    log = sb.node_agent_log(kube, RELEASE_NS, forked.node)
    stripped = log.find(f"restore of {ns}/{source}: removed setuid")
    restored = log.find(f"restored {ns}/{source} into pid")
    assert 0 <= stripped < restored, "no strip logged before the restore"
    assert f"rootfs/{SUID[1:]} (setuid)" in log[stripped:restored]
    print(f"  {fork}: restored on {forked.node}, {SUID} stripped to {mode} before CRIU ran")
    return forked


def test_tampered_foreign_and_swapped_checkpoints_are_refused_and_setuid_stripped(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig, s3_for_pods: S3,
) -> None:
    started = time.monotonic()
    name, where = sb.start_on_spot(kube, e2e_config, RELEASE_NS, namespace)
    sb.exec_sh(namespace, where.pod,
               f"{BUSYBOX} cp {BUSYBOX} {SUID} && {BUSYBOX} chmod 4755 {SUID}")
    assert sb.exec_sh(namespace, where.pod, f"{BUSYBOX} stat -c %a {SUID}").strip() == "4755"
    flipped, clean = (sb.checkpoint_now(namespace, name, f"{name}-{s}") for s in ("c1", "c2"))
    s3c = _s3c(s3_for_pods)
    other_ns = f"{namespace[:50]}-b"
    body: Any = {"metadata": {"name": other_ns}}
    kube.api.create_namespace(body)
    try:
        _flip_a_byte(s3c, _manifest_key(flipped))
        sb.create_sandbox(other_ns, name, sb.stateful_spec(
            e2e_config.sandbox_image, restoreFrom=clean["metadata"]["name"]))
        _copy_to_namespace(s3c, clean, namespace, other_ns)
        forks = [_fork(e2e_config, namespace, f"{name}-{s}", src["metadata"]["name"])
                 for s, src in (("flip", flipped), ("suid", clean))]
        _refused(kube, namespace, forks[0], flipped["metadata"]["name"],
                 "manifest digest")
        _refused(kube, other_ns, name, clean["metadata"]["name"],
                 f"it is sealed for checkpoint {namespace}/{clean['metadata']['name']} of "
                 f"sandbox {name}")
        _setuid_stripped(kube, namespace, forks[1], clean["metadata"]["name"])

        # The fork's first checkpoint: signed for its lineage, and (same store, inherited
        # data key) its chunks copied from the source's rather than uploaded.
        first = sb.checkpoint_now(namespace, forks[1], f"{forks[1]}-f1")
        uids = [sb.sandbox(namespace, n)["metadata"]["uid"] for n in (name, forks[1])]
        assert first["status"]["lineage"] == uids, first["status"]
        # Without the inherited key it would send about what the source's first did (every
        # chunk name differs). With it, only the chunks the fork changed go: a few dirty
        # pages make a whole 4 MiB chunk new, so that is one to three chunks of the ~30 MB
        # depending on how long the fork ran (6.4 MB and 8.5 MB seen): half separates the
        # two cases without depending on that timing.
        sent, full = first["status"]["uploadedBytes"], flipped["status"]["uploadedBytes"]
        assert sent < full // 2, f"the fork's first checkpoint sent {sent} bytes of {full}"
        print(f"  {forks[1]}: first checkpoint sent {sent} bytes (the source's first: "
              f"{full}); lineage {first['status']['lineage']}")

        # Another sandbox's manifest put in place of the fork's: refused.
        body = s3c.get_object(Bucket=BUCKET, Key=_manifest_key(clean))["Body"].read()
        s3c.put_object(Bucket=BUCKET, Key=_manifest_key(first), Body=body)
        swap = _fork(e2e_config, namespace, f"{name}-swap", first["metadata"]["name"])
        _refused(kube, namespace, swap, first["metadata"]["name"],
                 "manifest digest")
    finally:
        kube.api.delete_namespace(other_ns, grace_period_seconds=0)
    print(f"refused before CRIU: flipped byte, another namespace, swapped manifest; setuid "
          f"stripped; {sb.since(started):.0f}s")
