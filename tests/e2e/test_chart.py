"""What the chart promises about its own pods, on a real cluster: both become Ready
through their readiness probes and answer their liveness probes (a standby operator
too), the node-agent's root filesystem is read-only while /tmp is writable, and the
optional NetworkPolicies are accepted by the API server, and the CRDs served are the
worktree's, owned and kept by the release. (That the read-only node-agent still
checkpoints and restores is what every move test in test_moves.py shows.)"""

from __future__ import annotations

import os
import subprocess
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.stream import stream

from hermit_common.health import LIVENESS_PATH, READINESS_PATH
from tests.e2e.cluster import RELEASE, REPO, Kube, helm_binary, wait_until
from tests.support.crds import CRDS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

METRICS_PORT = 9101  # the chart's metrics.port, which also serves the probes

# Asks both probe endpoints from inside a container (the hermit image has python3).
PROBE_SCRIPT = f"""
import urllib.error, urllib.request
for path in ({LIVENESS_PATH!r}, {READINESS_PATH!r}):
    try:
        with urllib.request.urlopen("http://127.0.0.1:{METRICS_PORT}" + path, timeout=5) as r:
            print(path, r.status, r.read().decode().strip())
    except urllib.error.HTTPError as exc:
        print(path, exc.code, exc.read().decode().strip())
"""


def run(ns: str, pod: str, *argv: str) -> str:
    """stdout and stderr of ``argv`` run in the pod's (only) container."""
    out = stream(client.CoreV1Api().connect_get_namespaced_pod_exec, pod, ns,
                 command=list(argv), stderr=True, stdin=False, stdout=True, tty=False)
    return str(out)


def probes(ns: str, pod: str) -> dict[str, tuple[int, str]]:
    """{path: (HTTP status, body)} of the pod's own /healthz and /readyz."""
    out = run(ns, pod, "python3", "-c", PROBE_SCRIPT)
    answers = {}
    for line in out.splitlines():
        path, _, rest = line.partition(" ")
        status, _, body = rest.partition(" ")
        if path in (LIVENESS_PATH, READINESS_PATH) and status.isdigit():
            answers[path] = (int(status), body)
    assert set(answers) == {LIVENESS_PATH, READINESS_PATH}, out
    return answers


def component_pods(kube: Kube, ns: str, component: str) -> list[Any]:
    pods = kube.api.list_namespaced_pod(
        ns, label_selector=f"app.kubernetes.io/component={component}").items
    return [p for p in pods if p.metadata.deletion_timestamp is None]


def ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def restarts(kube: Kube, ns: str) -> dict[str, int]:
    return {p.metadata.name: sum(s.restart_count for s in p.status.container_statuses or [])
            for p in kube.api.list_namespaced_pod(ns).items}


def wait_all_ready(kube: Kube, ns: str, component: str, count: int | None = None) -> list[Any]:
    def probe() -> list[Any] | None:
        pods = component_pods(kube, ns, component)
        enough = len(pods) == count if count is not None else bool(pods)
        return pods if enough and all(ready(p) for p in pods) else None

    pods: list[Any] = wait_until(f"{count or 'all'} {component} pods Ready", 180, probe)
    for pod in pods:
        (c,) = pod.spec.containers
        assert c.readiness_probe.http_get.path == READINESS_PATH
        assert c.liveness_probe.http_get.path == LIVENESS_PATH
    return pods


def test_node_agents_are_ready_by_their_probes_with_a_read_only_root(
    kube: Kube, hermit_release: str,
) -> None:
    before = restarts(kube, hermit_release)
    agents = wait_all_ready(kube, hermit_release, "node-agent")
    for pod in agents:
        name = pod.metadata.name
        answers = probes(hermit_release, name)
        assert answers[LIVENESS_PATH][0] == 200, answers
        assert answers[READINESS_PATH] == (
            200, "ok: watching for interruptions; the Kubernetes API answers"), answers
        out = run(hermit_release, name, "sh", "-c",
                  "touch /x; echo rc=$?; touch /tmp/x && echo tmp-ok")
        assert "Read-only file system" in out and "rc=1" in out, out
        assert "tmp-ok" in out, f"/tmp must stay writable (CRIU's mount points): {out}"
        print(f"{name} on {pod.spec.node_name}: {answers[READINESS_PATH][1]}; "
              f"root read-only, /tmp writable")
    after = restarts(kube, hermit_release)
    assert {k: v for k, v in after.items() if k in before and v != before[k]} == {}


def test_pods_run_the_images_the_release_names_by_digest(
    kube: Kube, hermit_release: str,
) -> None:
    """Every container of the release's pods runs the very image its spec names: with
    images pinned by digest (hack/test ci installs the release from the cluster's
    registry, hack/cluster registry), the image the kubelet reports has that digest, so
    the nodes pulled it from the registry."""
    pods = kube.api.list_namespaced_pod(hermit_release).items
    assert pods, "the release runs no pod"
    pinned = 0
    for pod in pods:
        statuses = {c.name: c for c in [*(pod.status.init_container_statuses or []),
                                        *(pod.status.container_statuses or [])]}
        for container in [*(pod.spec.init_containers or []), *pod.spec.containers]:
            status = statuses.get(container.name)
            if "@sha256:" not in container.image or status is None or not status.image_id:
                continue
            assert status.image_id.endswith(container.image.rsplit("@", 1)[1]), (
                pod.metadata.name, container.image, status.image_id)
            pinned += 1
            print(f"{pod.metadata.name}/{container.name} on {pod.spec.node_name}: "
                  f"{container.image}")
    helm_set = os.environ.get("HERMIT_E2E_HELM_SET", "")
    if "image.digest=" in helm_set:  # the release was told digests: every pod uses them
        assert pinned >= len(pods), f"{pinned} pinned containers in {len(pods)} pods"


def test_a_standby_operator_is_live_and_ready_and_the_leader_runs_kopf(
    kube: Kube, hermit_release: str,
) -> None:
    apps, coordination = client.AppsV1Api(), client.CoordinationV1Api()
    deployment = f"{hermit_release}-operator"
    (single,) = wait_all_ready(kube, hermit_release, "operator", 1)
    answers = probes(hermit_release, single.metadata.name)
    assert answers[READINESS_PATH] == (200, "ok: leading: kopf runs"), answers
    apps.patch_namespaced_deployment_scale(deployment, hermit_release,
                                           {"spec": {"replicas": 2}})
    try:
        pods = wait_all_ready(kube, hermit_release, "operator", 2)
        leader = coordination.read_namespaced_lease(
            "hermit-operator", hermit_release).spec.holder_identity
        for pod in pods:
            answers = probes(hermit_release, pod.metadata.name)
            role = "leading" if pod.metadata.name == leader else "standing by"
            assert answers[LIVENESS_PATH][0] == 200, answers
            assert answers[LIVENESS_PATH][1].startswith(f"ok: {role}"), answers
            assert answers[READINESS_PATH][0] == 200, answers
            assert answers[READINESS_PATH][1].startswith(f"ok: {role}"), answers
            print(f"{pod.metadata.name}: {answers[LIVENESS_PATH][1]} / "
                  f"{answers[READINESS_PATH][1]}")
    finally:
        apps.patch_namespaced_deployment_scale(deployment, hermit_release,
                                               {"spec": {"replicas": 1}})
    # One replica again, leading (the other one may have been the leader: it handed over).
    (last,) = wait_all_ready(kube, hermit_release, "operator", 1)
    wait_until("the remaining operator leads", 60, lambda: probes(
        hermit_release, last.metadata.name)[READINESS_PATH] == (200, "ok: leading: kopf runs"))


def test_the_network_policies_are_valid_for_the_api_server(
    kube: Kube, hermit_release: str,
) -> None:
    out = subprocess.run(
        [helm_binary(), "template", "hermit", str(REPO / "charts/hermit"), "-n",
         hermit_release, "--set", "s3.bucket=b3t", "--set", "networkPolicy.enabled=true",
         "--set", "s3.endpoint=http://10.213.0.1:9000",
         "--set", "networkPolicy.apiServerCidrs={10.213.0.1/32}",
         "--show-only", "templates/networkpolicy.yaml"],
        check=True, capture_output=True, text=True, timeout=60).stdout
    policies = [d for d in yaml.safe_load_all(out) if d]
    # The operator's, the node-agent's and the ensure-secrets hook Job's.
    assert sorted(p["metadata"]["labels"]["app.kubernetes.io/component"]
                  for p in policies) == ["ensure-secrets", "node-agent", "operator"]
    networking = client.NetworkingV1Api()
    for policy in policies:
        created = networking.create_namespaced_network_policy(
            hermit_release, policy, dry_run="All")
        assert created.spec.pod_selector.match_labels[
            "app.kubernetes.io/component"] == policy["metadata"]["labels"][
            "app.kubernetes.io/component"]


def test_the_release_installs_this_worktrees_crds_owns_them_and_keeps_them(
    kube: Kube, hermit_release: str,
) -> None:
    """crds.enabled and crds.keep (docs/operations.md#the-crds): the CRDs served are this
    worktree's crds/ (the harness adopted any it found, and the chart upgraded them),
    owned by the release and annotated to outlive `helm uninstall`."""
    ext = client.ApiextensionsV1Api()
    for crd in CRDS.values():
        name = crd["metadata"]["name"]
        live = ext.read_custom_resource_definition(name)
        labels, annotations = live.metadata.labels or {}, live.metadata.annotations or {}
        assert labels.get("app.kubernetes.io/managed-by") == "Helm", name
        assert annotations.get("meta.helm.sh/release-name") == RELEASE, name
        assert annotations.get("meta.helm.sh/release-namespace") == hermit_release, name
        assert annotations.get("helm.sh/resource-policy") == "keep", name
        for record in crd["spec"]["versions"]:
            (version,) = [v for v in live.spec.versions if v.name == record["name"]]
            assert [c.name for c in version.additional_printer_columns or []] == [
                c["name"] for c in record.get("additionalPrinterColumns", [])], name
            schema = record["schema"]["openAPIV3Schema"]["properties"]
            served = version.schema.open_apiv3_schema.properties
            for part in ("spec", "status"):
                assert sorted(served[part].properties or {}) == sorted(
                    schema[part].get("properties", {})), (name, part)
