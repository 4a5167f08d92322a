"""Per-sandbox storage on the cluster: two sandboxes on one spot node, each with its own
bucket (one with the node-agent's own credentials, one with a Secret in its namespace).

A checkpoint with a wrong Secret fails with why and the sandbox runs on; with the Secret
fixed, a spot notice checkpoints both, each only into its own bucket (both buckets and the
chart's are listed), and both restore and continue. Then one sandbox is suspended, its
storage changed, and resumed: it is restored from where the checkpoint was written.
The chart's nodeAgent.perSandboxStorage is turned on for the test's namespace only (off by
default): the operator (its key service) may read Secrets there and nowhere else; the
node-agent may read none, and gets STS credentials for its sandbox's prefix of the
sandbox's own bucket from the key service (docs/storage.md#per-sandbox-store-credentials).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hermit_common import api, protocol
from hermit_common.settings import StoreSettings
from hermit_common.store import CheckpointStore
from tests.e2e import sandboxes as sb
from tests.e2e.cluster import (
    BUCKET,
    RELEASE,
    RELEASE_NS,
    REPO,
    S3,
    E2EConfig,
    Kube,
    helm_binary,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

Obj = dict[str, Any]

NOTICE_SECONDS = 30
SECRET = "team-b-s3"


def _store(s3: S3, bucket: str) -> CheckpointStore:
    """A store on the e2e MinIO with its root credentials (they can make buckets)."""
    return CheckpointStore(StoreSettings(bucket=bucket, endpoint_url=s3.endpoint,
                                         access_key_id=s3.access_key,
                                         secret_access_key=s3.secret_key, max_attempts=2))


def _keys(s3: S3, bucket: str, prefix: str = "") -> list[str]:
    store = _store(s3, bucket)
    pages = store.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def _sandboxes_in(keys: list[str]) -> set[str]:
    """<prefix...>/<namespace>/<sandbox> of every chunk, manifest and (sealed) key object."""
    return {k.split("/chunks/")[0].split("/checkpoints/")[0].split("/keys/")[0] for k in keys}


def _per_sandbox_storage(cfg: E2EConfig, namespaces: list[str]) -> None:
    """Turn the chart's nodeAgent.perSandboxStorage on for ``namespaces``, or off (none);
    the node-agents roll. team-a's storage (another bucket, no secretRef) uses the
    node-agent's own credentials, which only the shared fallback gives it (with scoped
    store credentials it has none: docs/storage.md#scoped-store-credentials); so that
    is on with it, and off again after."""
    on = str(bool(namespaces)).lower()
    proc = subprocess.run(
        [helm_binary(), "upgrade", RELEASE, str(REPO / "charts/hermit"), "-n", RELEASE_NS,
         "--reuse-values", "--set", f"nodeAgent.perSandboxStorage={on}",
         "--set", f"s3.sharedNodeCredentials={on}",
         "--set-json", f"nodeAgent.perSandboxStorageNamespaces={json.dumps(namespaces)}",
         "--wait", "--timeout", "180s"],
        env={**os.environ, "KUBECONFIG": cfg.kubeconfig}, capture_output=True, text=True,
        check=False)
    assert proc.returncode == 0, f"helm upgrade failed: {proc.stdout}{proc.stderr}"


def _may_get_secrets(cfg: E2EConfig, namespace: str, component: str = "node-agent") -> bool:
    pods = client.CoreV1Api().list_namespaced_pod(
        RELEASE_NS, label_selector=f"app.kubernetes.io/component={component}").items
    assert pods and pods[0].spec is not None, f"no {component} pod in {RELEASE_NS}"
    account = pods[0].spec.service_account_name
    proc = subprocess.run(
        [str(Path(os.environ.get("HERMIT_CACHE", Path.home() / ".cache/hermit"))
             / "bin" / "kubectl"), "--kubeconfig", cfg.kubeconfig, "auth", "can-i", "get",
         "secrets", "-n", namespace, f"--as=system:serviceaccount:{RELEASE_NS}:{account}"],
        capture_output=True, text=True, check=False)
    return proc.stdout.strip() == "yes"


@pytest.fixture
def per_sandbox_storage(hermit_release: str, namespace: str, e2e_config: E2EConfig
                        ) -> Iterator[str]:
    """The release with per-sandbox storage on for the test's namespace (it is off by
    default), then off again, so the rest of the session sees the chart's defaults
    (test_security compares its RBAC). The API server lets the operator read Secrets
    there, and in no other namespace; the node-agent in none."""
    _per_sandbox_storage(e2e_config, [namespace])
    try:
        assert _may_get_secrets(e2e_config, namespace, "operator")
        for elsewhere in ("kube-system", "default"):
            assert not _may_get_secrets(e2e_config, elsewhere, "operator"), elsewhere
        for anywhere in (namespace, "kube-system", "default", RELEASE_NS):
            assert not _may_get_secrets(e2e_config, anywhere), anywhere
        print(f"\noperator may get Secrets in {namespace} only (not kube-system, default); "
              f"the node-agent in none")
        yield hermit_release
    finally:
        _per_sandbox_storage(e2e_config, [])


@pytest.fixture
def buckets(s3_for_pods: S3) -> Iterator[tuple[str, str]]:
    tag = uuid.uuid4().hex[:6]
    names = (f"e2e-team-a-{tag}", f"e2e-team-b-{tag}")
    for name in names:
        _store(s3_for_pods, name).ensure_bucket()
    yield names
    for name in names:
        store = _store(s3_for_pods, name)
        for key in _keys(s3_for_pods, name):
            store.client.delete_object(Bucket=name, Key=key)
        store.client.delete_bucket(Bucket=name)


def _put_secret(ns: str, access: str, secret: str) -> None:
    body: Any = {"metadata": {"name": SECRET}, "data": {
        api.STORAGE_SECRET_ACCESS_KEY_ID: base64.b64encode(access.encode()).decode(),
        api.STORAGE_SECRET_SECRET_ACCESS_KEY: base64.b64encode(secret.encode()).decode()}}
    core = client.CoreV1Api()
    try:
        core.create_namespaced_secret(ns, body)
    except ApiException as exc:
        if exc.status != 409:
            raise
        core.replace_namespaced_secret(SECRET, ns, body)


def _request_checkpoint(ns: str, sandbox: str, name: str) -> None:
    sb.custom().create_namespaced_custom_object(
        api.GROUP, api.VERSION, ns, api.CHECKPOINT_PLURAL, {
            "apiVersion": api.API_VERSION, "kind": api.CHECKPOINT_KIND,
            "metadata": {"name": name},
            "spec": {"sandboxRef": {"name": sandbox}, "reason": "Manual"}})


def _checkpoint(ns: str, name: str) -> Obj:
    obj: Any = sb.custom().get_namespaced_custom_object(
        api.GROUP, api.VERSION, ns, api.CHECKPOINT_PLURAL, name)
    return dict(obj)


def _finished(ns: str, name: str) -> Obj | None:
    c = _checkpoint(ns, name)
    return c if (c.get("status") or {}).get("phase") in ("Completed", "Failed") else None


def _start_pair(kube: Kube, cfg: E2EConfig, ns: str, s3: S3, a_bucket: str, b_bucket: str
                ) -> tuple[str, str, sb.Running, sb.Running]:
    """team-a: its own bucket and prefix, the node-agent's credentials; team-b: its own
    bucket, endpoint and Secret; both on the same spot node."""
    name_a, where_a = sb.start_on_spot(kube, cfg, RELEASE_NS, ns, checkpoint={
        "storage": {"bucket": a_bucket, "prefix": "tenants/a"}})
    name_b = f"agent-{uuid.uuid4().hex[:6]}"
    spec = sb.stateful_spec(cfg.sandbox_image, checkpoint={"storage": {
        "bucket": b_bucket, "endpoint": s3.endpoint, "secretRef": {"name": SECRET}}})
    # Wherever team-a's pod runs (now, and after the move): one notice moves both.
    spec["podTemplate"]["spec"]["affinity"] = {"podAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": {"matchLabels": {protocol.LABEL_SANDBOX: name_a}},
            "topologyKey": "kubernetes.io/hostname"}]}}
    sb.create_sandbox(ns, name_b, spec)
    where_b = sb.wait_running(kube, ns, name_b, min_ticks=5)
    assert where_b.node == where_a.node
    for name in (name_a, name_b):  # kept: the cluster's CRD knows the field
        assert sb.sandbox(ns, name)["spec"]["checkpoint"].get("storage"), name
    return name_a, name_b, where_a, where_b


def _wrong_secret_fails_and_the_sandbox_runs_on(kube: Kube, ns: str, name_b: str,
                                                where_b: sb.Running, wrong: str) -> None:
    manual = f"{name_b}-bad-credentials"
    _request_checkpoint(ns, name_b, manual)
    failed = wait_until(f"checkpoint {manual} finished", 120, lambda: _finished(ns, manual))
    message = str(failed["status"].get("message"))
    agent_log = [line for line in sb.node_agent_log(kube, RELEASE_NS, where_b.node).splitlines()
                 if manual in line]
    assert failed["status"]["phase"] == "Failed", (message, failed["status"].get("storage"),
                                                   agent_log)
    # The key service's STS AssumeRole with the Secret's wrong key is refused (the default
    # nodeAgent.perSandboxStoreCredentials: sts); the node-agent never saw the Secret.
    assert "AssumeRole" in message and "sandbox left running" in message, message
    assert wrong not in message
    warnings = sb.wait_events(kube, ns, manual, "a CheckpointFailed Event", lambda e: e[
        "reason"] == "CheckpointFailed")
    assert "AssumeRole" in str(warnings[0]["message"]), warnings
    before = sb.ticks(kube, ns, where_b.pod)[-1]
    wait_until("team-b ticking after the failed checkpoint", 30,
               lambda: sb.ticks(kube, ns, where_b.pod)[-1] > before + 3)
    assert sb.status(ns, name_b)["phase"] == "Running"
    print(f"wrong Secret: {manual} Failed: {message}")


def _preempt_both(kube: Kube, cfg: E2EConfig, ns: str, names: tuple[str, str],
                  where: tuple[sb.Running, sb.Running]) -> tuple[Obj, Obj]:
    """A spot notice on the shared node: each sandbox checkpoints, moves and continues."""
    node = where[0].node
    sb.wait_agent_ready(kube, RELEASE_NS, node)
    started = time.monotonic()
    with sb.preempting(cfg, node, NOTICE_SECONDS):
        # Both old pods are read while either checkpoint is taken: each is frozen from
        # its own checkpoint until it is deleted.
        old = [sb.LastTick(kube, ns, w.pod) for w in where]
        ckpts = [sb.durable_reading(f"a Completed Preemption checkpoint of {n}",
                                    NOTICE_SECONDS, sb.completed_checkpoint(
                                        ns, "Preemption", sandbox_name=n), old)
                 for n in names]
        last = [o.final() for o in old]
        for n, w, final in zip(names, where, last, strict=True):
            after = sb.wait_running(kube, ns, n, restores=1, avoid=node, timeout=180,
                                    min_ticks=1)
            sb.assert_continues(kube, ns, after.pod, final, exact=True)
            print(f"{n}: {w.node} -> {after.node}, running {sb.since(started)} s after the "
                  f"notice")
    return ckpts[0], ckpts[1]


def _assert_each_in_its_own_bucket(s3: S3, ns: str, names: tuple[str, str],
                                   buckets: tuple[str, str], ckpts: tuple[Obj, Obj]) -> None:
    (name_a, name_b), (a_bucket, b_bucket) = names, buckets
    assert ckpts[0]["status"]["storage"] == {"bucket": a_bucket, "prefix": "tenants/a",
                                             "region": "us-east-1",
                                             "endpoint": s3.endpoint}, ckpts[0]["status"]
    assert ckpts[1]["status"]["storage"]["bucket"] == b_bucket, ckpts[1]["status"]
    assert ckpts[0]["status"]["manifestURI"].startswith(f"s3://{a_bucket}/tenants/a/{ns}/")
    assert ckpts[1]["status"]["manifestURI"].startswith(f"s3://{b_bucket}/hermit/{ns}/")
    in_a, in_b = _keys(s3, a_bucket), _keys(s3, b_bucket)
    assert _sandboxes_in(in_a) == {f"tenants/a/{ns}/{name_a}"}, in_a[:5]
    assert _sandboxes_in(in_b) == {f"hermit/{ns}/{name_b}"}, in_b[:5]
    for name in names:  # the default bucket holds nothing of either
        assert _keys(s3, BUCKET, f"hermit/{ns}/{name}/") == []
    print(f"{a_bucket}: {len(in_a)} objects, all of {name_a}; {b_bucket}: {len(in_b)} "
          f"objects, all of {name_b}; none in {BUCKET}")


def _suspend_change_storage_resume(kube: Kube, ns: str, name: str, s3: S3,
                                   moved_to: str) -> None:
    """The Suspend checkpoint is written to the sandbox's bucket; its storage then changes;
    the resume still restores it from where it was written."""
    pod = sb.status(ns, name)["podName"]
    seen_last = [wait_until(f"ticks in pod {pod}", 60,
                            lambda: sb.ticks(kube, ns, pod) or None)[-1]]

    def suspended() -> bool:
        seen_last.append(max([*sb.ticks(kube, ns, pod), seen_last[-1]]))
        return sb.status(ns, name).get("phase") == "Suspended"

    sb.patch_sandbox(ns, name, {"suspend": True})
    wait_until("team-a Suspended", 120, suspended, 0.2)
    suspend = sb.completed_checkpoint(ns, "Suspend", sandbox_name=name)()
    assert suspend is not None, "no Completed Suspend checkpoint"
    written = suspend["status"]["storage"]["bucket"]
    sb.patch_sandbox(ns, name, {"checkpoint": {"storage": {"bucket": moved_to,
                                                           "prefix": "tenants/a-v2"}}})
    sb.patch_sandbox(ns, name, {"suspend": False})
    resumed = sb.wait_running(kube, ns, name, restores=2, min_ticks=1)
    sb.assert_continues(kube, ns, resumed.pod, seen_last[-1])
    assert (sb.status(ns, name).get("restoredFrom") or {}).get("name") == \
        suspend["metadata"]["name"]
    assert _keys(s3, moved_to, "tenants/a-v2/") == [], "restored from the new place?"
    print(f"{name}: suspended into {written}, storage changed to {moved_to}, resumed from "
          f"{suspend['metadata']['name']} in {written}")


def test_each_sandbox_checkpoints_into_its_own_bucket_and_restores_from_it(
    kube: Kube, namespace: str, per_sandbox_storage: str, e2e_config: E2EConfig,
    s3_for_pods: S3, buckets: tuple[str, str],
) -> None:
    a_bucket, b_bucket = buckets
    wrong = "wrong-" + uuid.uuid4().hex
    _put_secret(namespace, s3_for_pods.access_key, wrong)
    name_a, name_b, where_a, where_b = _start_pair(kube, e2e_config, namespace, s3_for_pods,
                                                   a_bucket, b_bucket)
    _wrong_secret_fails_and_the_sandbox_runs_on(kube, namespace, name_b, where_b, wrong)
    _put_secret(namespace, s3_for_pods.access_key, s3_for_pods.secret_key)

    names = (name_a, name_b)
    ckpts = _preempt_both(kube, e2e_config, namespace, names, (where_a, where_b))
    _assert_each_in_its_own_bucket(s3_for_pods, namespace, names, buckets, ckpts)
    _suspend_change_storage_resume(kube, namespace, name_a, s3_for_pods, moved_to=b_bucket)
