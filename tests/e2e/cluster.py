"""Fixtures for end-to-end tests against any Kubernetes cluster named by KUBECONFIG.

A plugin of every session (tests/conftest.py), not a conftest of tests/e2e: the fault
suite (tests/faults) uses the same session fixtures, and a run of both tiers
(hack/test ci) installs the release once.

Nothing here knows how the cluster was made (hack/cluster, kind, a cloud): the
cluster is found through KUBECONFIG only. Cluster-specific actions that have no
Kubernetes API (preempting a spot node, adding one) are commands given in
environment variables; defaults drive hack/cluster. See docs/cluster.md.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from hermit_testbed.errors import TestbedError
from hermit_testbed.minio import MinioServer, start_minio, stop_minio
from tests.support import diagnostics
from tests.support import ledger as tick_ledger_mod
from tests.support.crds import CRD_NAMES, adopt_crds
from tests.support.wait import wait_until

REPO = Path(__file__).resolve().parents[2]

SPOT_LABEL = "karpenter.sh/capacity-type"
# How each provider marks a spot node (hack/cluster gives each spot node one of them).
SPOT_NODE_LABELS = {
    "karpenter": ("karpenter.sh/capacity-type", "spot"),
    "eks": ("eks.amazonaws.com/capacityType", "SPOT"),
    "gke-spot": ("cloud.google.com/gke-spot", "true"),
    "gke-provisioning": ("cloud.google.com/gke-provisioning", "spot"),
    "aks": ("kubernetes.azure.com/scalesetpriority", "spot"),
}
IMDS_ANNOTATION = "hermit.dev/imds-url"


@dataclass(frozen=True)
class E2EConfig:
    kubeconfig: str
    sandbox_image: str
    preempt_cmd: str
    add_node_cmd: str
    rebalance_cmd: str = ""
    # A node lost without any notice (the instance gone at once): no checkpoint is taken.
    lose_node_cmd: str = ""
    # The preempt command ends its notice at once on SIGUSR1 (hack/cluster's does).
    preempt_ends_early: bool = False
    # Starts the SIG's agent-sandbox controller and its CRDs (idempotent; test_agent_sandbox).
    agent_sandbox_cmd: str = ""
    # Stops kube-apiserver and starts it again, returning once it is ready (a fault).
    restart_apiserver_cmd: str = ""


def _e2e_config() -> E2EConfig:
    env = os.environ
    return E2EConfig(
        kubeconfig=env.get("KUBECONFIG", ""),
        sandbox_image=env.get("HERMIT_E2E_SANDBOX_IMAGE", "hermit.local/sandbox:v1"),
        preempt_cmd=env.get(
            "HERMIT_E2E_PREEMPT_CMD",
            f"{REPO}/hack/cluster preempt-node {{node}} --notice {{notice}}",
        ),
        add_node_cmd=env.get("HERMIT_E2E_ADD_NODE_CMD", f"{REPO}/hack/cluster add-node --spot"),
        rebalance_cmd=env.get("HERMIT_E2E_REBALANCE_CMD",
                              f"{REPO}/hack/cluster rebalance-node {{node}}"),
        lose_node_cmd=env.get("HERMIT_E2E_LOSE_NODE_CMD",
                              f"{REPO}/hack/cluster preempt-node {{node}} --no-notice"),
        preempt_ends_early=env.get("HERMIT_E2E_PREEMPT_ENDS_EARLY",
                                   "0" if "HERMIT_E2E_PREEMPT_CMD" in env else "1") == "1",
        agent_sandbox_cmd=env.get("HERMIT_E2E_AGENT_SANDBOX_CMD",
                                  f"{REPO}/hack/cluster agent-sandbox"),
        restart_apiserver_cmd=env.get("HERMIT_E2E_RESTART_APISERVER_CMD",
                                      f"{REPO}/hack/cluster restart-apiserver"),
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Iterator[pytest.TestReport]:
    """A failed e2e test leaves the cluster's state at the failure (while its namespace
    still exists) in a file outside the repository, named in the report."""
    report: pytest.TestReport = yield
    cluster_tier = item.get_closest_marker("e2e") or item.get_closest_marker("faults")
    if report.failed and report.when in ("call", "setup") and cluster_tier and \
            isinstance(item, pytest.Function) and "kube" in item.fixturenames:
        namespace = item.funcargs.get("namespace")
        path = diagnostics.dump(item.nodeid, namespace if isinstance(namespace, str)
                                else None, RELEASE_NS)
        report.sections.append(("diagnostics", f"cluster state at the failure: {path}"))
        print(f"\ndiagnostics of {item.nodeid}: {path}")
    return report


@pytest.fixture(scope="session")
def e2e_config() -> E2EConfig:
    return _e2e_config()


Obj = dict[str, Any]


class Kube:
    """The few core API calls the e2e tests need, returning plain JSON dicts."""

    def __init__(self, api: client.CoreV1Api) -> None:
        self.api = api

    @staticmethod
    def _json(resp: Any) -> Obj:
        data: Obj = json.loads(resp.data)
        return data

    def nodes(self) -> list[Obj]:
        items: list[Obj] = self._json(self.api.list_node(_preload_content=False))["items"]
        return items

    def node(self, name: str) -> Obj | None:
        try:
            return self._json(self.api.read_node(name, _preload_content=False))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def pod(self, ns: str, name: str) -> Obj | None:
        try:
            return self._json(self.api.read_namespaced_pod(name, ns, _preload_content=False))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def create_pod(self, ns: str, manifest: Obj) -> None:
        body: Any = manifest  # the client accepts plain dicts
        self.api.create_namespaced_pod(ns, body)

    def pod_log(self, ns: str, name: str) -> str:
        log: str | None = self.api.read_namespaced_pod_log(name, ns)
        return log or ""  # the client gives None for an empty body


def name_of(obj: Obj) -> str:
    name: str = obj["metadata"]["name"]
    return name


def labels_of(obj: Obj) -> dict[str, str]:
    labels: dict[str, str] = obj["metadata"].get("labels") or {}
    return labels


def spot_conventions(node: Obj) -> list[str]:
    """The conventions by which the node is labelled spot (empty: an on-demand node)."""
    labels = labels_of(node)
    return [name for name, (key, value) in SPOT_NODE_LABELS.items() if labels.get(key) == value]


def is_spot(node: Obj) -> bool:
    return bool(spot_conventions(node))


def is_ready(node: Obj) -> bool:
    conds = node.get("status", {}).get("conditions") or []
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conds)
    return ready and not node.get("spec", {}).get("unschedulable", False)


@pytest.fixture(scope="session")
def kube(e2e_config: E2EConfig, tick_ledger: tick_ledger_mod.Collector | None) -> Kube:
    """The cluster in KUBECONFIG; fails (never skips) when there is none. Every test of the
    cluster tiers asks for it, so the session's tick ledger runs before their first
    sandbox."""
    hint = "no cluster: run hack/cluster up and export KUBECONFIG=$(hack/cluster kubeconfig)"
    if not e2e_config.kubeconfig:
        pytest.fail(f"{hint} (KUBECONFIG is not set)")
    load: Any = config.load_kube_config
    try:
        load(config_file=e2e_config.kubeconfig)
        api = client.CoreV1Api()
        api.list_namespace(limit=1, _request_timeout=10)
    except Exception as exc:
        pytest.fail(f"{hint} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
    return Kube(api)


@pytest.fixture
def namespace(kube: Kube, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test, deleted afterwards."""
    base = request.node.name.lower().replace("_", "-")[:40].strip("-")
    name = f"e2e-{base}-{uuid.uuid4().hex[:6]}"
    body: Any = {"metadata": {"name": name}}
    kube.api.create_namespace(body)
    wait_until(
        f"default service account in {name}",
        60,
        lambda: kube.api.read_namespaced_service_account("default", name),
    )
    yield name
    try:
        kube.api.delete_namespace(name, grace_period_seconds=0)
    except ApiException as exc:
        if exc.status != 404:  # a test may have deleted it itself
            raise


def ready_nodes(kube: Kube) -> list[Obj]:
    return [n for n in kube.nodes() if is_ready(n)]


def pod_manifest(
    name: str, node: str, image: str, command: list[str], **spec: Any
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "nodeName": node,
            "restartPolicy": spec.pop("restartPolicy", "Never"),
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": command,
                }
            ],
            **spec,
        },
    }


def wait_pod_phase(kube: Kube, ns: str, name: str, phases: set[str], timeout: float = 120) -> Obj:
    def probe() -> Obj | None:
        pod = kube.pod(ns, name) or {}
        status = pod.get("status", {})
        if status.get("phase") in phases:
            return pod
        if status.get("phase") == "Failed" and "Failed" not in phases:
            pytest.fail(f"pod {ns}/{name} failed: {status.get('message') or status.get('reason')}")
        return None

    return wait_until(f"pod {ns}/{name} in {sorted(phases)}", timeout, probe)


def run_cluster_command(template: str, **fields: str) -> subprocess.Popen[str]:
    """Starts a cluster-specific command (preempt, add-node) given as a template."""
    argv = shlex.split(template.format(**fields))
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# -- Hermit installed with its chart, and an S3 for it -----------------------------------

RELEASE = "hermit-e2e"
RELEASE_NS = "hermit-e2e"
POD_POLICY_PROFILE = os.environ.get("HERMIT_E2E_POD_POLICY_PROFILE", "baseline")
BUCKET = "hermit-e2e"


@dataclass(frozen=True)
class LocalCluster:
    """hack/cluster's layout (hack/cluster.d/env.sh) of its instance ``instance`` (0 unless
    hack/test ci runs two shards on two clusters); tests/unit/test_cluster_layout.py
    compares it with env.sh."""

    instance: int

    @property
    def host(self) -> str:
        """The host's address on the cluster bridge: pods reach it."""
        return f"10.{213 + 10 * self.instance}.0.1"

    @property
    def nodes(self) -> str:
        """The nodes' network on that bridge."""
        return f"10.{213 + 10 * self.instance}.0.0/24"

    @property
    def bridge(self) -> str:
        return f"hermit-br{self.instance}"

    @property
    def tag(self) -> str:
        return f"k{self.instance}" if self.instance else ""

    @property
    def cgroup_root(self) -> str:
        """Where its nodes' cgroups are, in every hierarchy (hermit/<node> on instance 0)."""
        return f"hermit{self.tag}"

    def netns(self, node: str) -> str:
        """A node's network namespace (hermit-<node> on instance 0)."""
        return f"hermit{self.tag}-{node}"

    def runs_on(self, pid: int, node: str) -> bool:
        """Whether host process ``pid`` is one of its node ``node``'s (in that node's cgroup:
        two clusters on one host have nodes of the same names)."""
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:
            return False
        return any(f":/{self.cgroup_root}/{node}/" in line for line in lines)


LOCAL_CLUSTER = LocalCluster(int(os.environ.get("HERMIT_CLUSTER_INSTANCE") or 0))
LOCAL_CLUSTER_HOST = LOCAL_CLUSTER.host
LOCAL_CLUSTER_NODES = LOCAL_CLUSTER.nodes
LOCAL_CLUSTER_BRIDGE = LOCAL_CLUSTER.bridge
node_netns = LOCAL_CLUSTER.netns


# Where the sandboxes' pods reach this test process: the external tick ledger listens there
# (tests/support/ledger.py). On another cluster, an address of this host its pods reach.
LEDGER_HOST = os.environ.get("HERMIT_E2E_LEDGER_HOST", LOCAL_CLUSTER_HOST)


@pytest.fixture(scope="session")
def tick_ledger() -> Iterator[tick_ledger_mod.Collector | None]:
    """The external tick ledger of the whole session: every sandbox the helpers create
    (tests/e2e/sandboxes.py stateful_spec) reports each tick to it."""
    try:
        collector = tick_ledger_mod.Collector(LEDGER_HOST).start()
    except OSError as exc:
        # Only the tests that judge ticks need it: they fail naming this (sb.assert_ledger).
        print(f"the tick ledger cannot listen on {LEDGER_HOST} ({exc}): run hack/cluster "
              "up, or set HERMIT_E2E_LEDGER_HOST to an address of this host the pods reach")
        yield None
        return
    tick_ledger_mod.use(collector)
    try:
        yield collector
    finally:
        tick_ledger_mod.use(None)
        collector.stop()


@dataclass
class S3:
    """The S3 the chart is installed with; ``server`` is set when the tests run it (MinIO
    on the local cluster's host bridge), so a test can stop and restart it."""

    endpoint: str
    access_key: str
    secret_key: str
    server: MinioServer | None = None
    workdir: Path | None = None

    def stop(self) -> None:
        if self.server is None:
            pytest.fail("this test stops S3: it needs the MinIO the tests start "
                        "(unset HERMIT_E2E_S3_ENDPOINT)")
        stop_minio(self.server)

    @contextmanager
    def black_holed(self) -> Iterator[None]:
        """While the block runs, every packet the local cluster's nodes send to this S3
        is dropped (an iptables rule on the host bridge): connections hang, nothing is
        refused, as behind a network partition or a dead load balancer. The test process
        itself still reaches it (over loopback)."""
        if self.server is None:
            pytest.fail("this test cuts S3 off: it needs the MinIO the tests start "
                        "(unset HERMIT_E2E_S3_ENDPOINT)")
        port = self.endpoint.rsplit(":", 1)[1]
        rule = ["INPUT", "-i", LOCAL_CLUSTER_BRIDGE, "-p", "tcp", "--dport", port, "-j", "DROP"]
        added = subprocess.run(["iptables", "-w", "-I", *rule], capture_output=True,
                               text=True, check=False)
        assert added.returncode == 0, f"iptables -I {' '.join(rule)}: {added.stderr}"
        try:
            yield
        finally:
            subprocess.run(["iptables", "-w", "-D", *rule], capture_output=True, check=False)

    @contextmanager
    def slowed_from(self, node: str, mbit: int) -> Iterator[None]:
        """While the block runs, what ``node`` of the local cluster sends to this S3 goes
        at most ``mbit`` Mbit/s (an HTB class for its port on the node's uplink, in the
        node's network namespace hermit-<node>: hack/cluster's layout); the rest of its
        traffic is untouched."""
        if self.server is None:
            pytest.fail("this test slows S3 down: it needs the MinIO the tests start "
                        "(unset HERMIT_E2E_S3_ENDPOINT)")
        port = self.endpoint.rsplit(":", 1)[1]
        tc = ["ip", "netns", "exec", node_netns(node), "tc"]
        steps = [
            ["qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "20"],
            ["class", "add", "dev", "eth0", "parent", "1:", "classid", "1:10", "htb",
             "rate", f"{mbit}mbit", "ceil", f"{mbit}mbit"],
            ["class", "add", "dev", "eth0", "parent", "1:", "classid", "1:20", "htb",
             "rate", "10gbit"],
            ["filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "u32",
             "match", "ip", "dport", port, "0xffff", "flowid", "1:10"],
        ]
        try:
            for step in steps:
                done = subprocess.run([*tc, *step], capture_output=True, text=True,
                                      check=False)
                assert done.returncode == 0, f"tc {' '.join(step)} on {node}: {done.stderr}"
            yield
        finally:
            subprocess.run([*tc, "qdisc", "del", "dev", "eth0", "root"], capture_output=True,
                           check=False)

    def start(self) -> None:
        assert self.server is not None and self.workdir is not None
        port = int(self.endpoint.rsplit(":", 1)[1])
        self.server = start_minio(self.workdir, port=port, host=LOCAL_CLUSTER_HOST)


@pytest.fixture(scope="session")
def s3_for_pods() -> Iterator[S3]:
    env = os.environ
    if env.get("HERMIT_E2E_S3_ENDPOINT"):
        yield S3(env["HERMIT_E2E_S3_ENDPOINT"], env.get("HERMIT_E2E_S3_ACCESS_KEY", ""),
                 env.get("HERMIT_E2E_S3_SECRET_KEY", ""))
        return
    with tempfile.TemporaryDirectory(prefix="hermit-e2e-minio-") as work:
        try:
            server = start_minio(Path(work), host=LOCAL_CLUSTER_HOST)
        except (TestbedError, OSError) as exc:
            pytest.fail(f"no S3 for the cluster: set HERMIT_E2E_S3_ENDPOINT, or run "
                        f"hack/cluster up so MinIO can listen on {LOCAL_CLUSTER_HOST} ({exc})")
        from hermit_common.store import CheckpointStore

        CheckpointStore(server.settings(BUCKET)).ensure_bucket()
        s3 = S3(server.endpoint, server.access_key, server.secret_key, server, Path(work))
        try:
            yield s3
        finally:
            if s3.server is not None:
                stop_minio(s3.server)


def helm_binary() -> str:
    cache = Path(os.environ.get("HERMIT_CACHE", Path.home() / ".cache/hermit"))
    helm = cache / "bin" / "helm"
    if not helm.exists():
        pytest.fail("helm not found: run hack/install-helm")
    return str(helm)


def helm_set(e2e_config: E2EConfig, release_ns: str, value: str) -> None:
    """``helm upgrade --reuse-values --set value`` of the e2e release, waited for: a
    setting one test needs (and puts back)."""
    proc = subprocess.run(
        [helm_binary(), "upgrade", RELEASE, str(REPO / "charts/hermit"), "-n", release_ns,
         "--reuse-values", "--set", value, "--wait", "--timeout", "180s"],
        env={**os.environ, "KUBECONFIG": e2e_config.kubeconfig}, capture_output=True,
        text=True, check=False)
    assert proc.returncode == 0, f"helm upgrade failed: {proc.stdout}{proc.stderr}"


def _apply_secret(kube: Kube, s3: S3) -> None:
    secret: Any = {"metadata": {"name": "hermit-s3"}, "data": {
        "AWS_ACCESS_KEY_ID": base64.b64encode(s3.access_key.encode()).decode(),
        "AWS_SECRET_ACCESS_KEY": base64.b64encode(s3.secret_key.encode()).decode()}}
    try:
        kube.api.create_namespaced_secret(RELEASE_NS, secret)
    except ApiException as exc:
        if exc.status != 409:
            raise
        kube.api.replace_namespaced_secret("hermit-s3", RELEASE_NS, secret)


def _adopt_crds() -> None:
    """The chart installs and upgrades this worktree's CRDs (templates/crds/, made from
    crds/), and keeps them on uninstall. CRDs left by another release, by an older chart's
    crds/ folder or by an older harness that applied them itself carry no ownership of
    this release, and `helm install` would refuse them: adopt them (hack/adopt-crds)."""
    adopted = adopt_crds(client.ApiextensionsV1Api(), RELEASE, RELEASE_NS)
    if adopted:
        print(f"adopted CRDs into release {RELEASE}: {', '.join(adopted)}")


def _wait_crds_established() -> None:
    ext = client.ApiextensionsV1Api()
    for name in CRD_NAMES:
        wait_until(f"CRD {name} Established", 60, lambda n=name: any(
            c.type == "Established" and c.status == "True"
            for c in ext.read_custom_resource_definition(n).status.conditions or []))


def release_values(s3: S3) -> list[str]:
    """The e2e release's helm flags, but its images (e2e_images): the same for this
    checkout's chart and for the previous release's (test_upgrade.py)."""
    return [
        "--set", f"s3.bucket={BUCKET}", "--set", f"s3.endpoint={s3.endpoint}",
        "--set", "s3.existingSecret=hermit-s3", "--set", "nodeAgent.logLevel=DEBUG",
        # S3 garbage collection without its minimum age: what retention drops goes at
        # once (test_gc.py), and every test runs with it.
        "--set", "nodeAgent.gc.minAgeSeconds=0",
        "--set-string", "operator.nodeSelector.karpenter\\.sh/capacity-type=on-demand",
        # The baseline pod policy: the sandboxes run as root, as their image says. Under
        # the restricted default they would run as 65532, and CRIU reads a non-root task's
        # rlimits with prlimit(2), which needs CAP_SYS_RESOURCE: hack/cluster's nodes run
        # in a container without it (docs/cluster.md), so no checkpoint could be taken.
        # test_policy.py switches to restricted for the test that shows it; a cluster
        # whose node-agents hold it can run everything so: HERMIT_E2E_POD_POLICY_PROFILE.
        "--set", f"operator.podPolicy.profile={POD_POLICY_PROFILE}",
        # The local cluster runs no cluster DNS: node-agents reach the operator's key
        # service by its Service's ClusterIP (docs/security.md#the-key-service).
        "--set", "nodeAgent.sealing.keyService.serviceLinks=true",
    ]


def e2e_images() -> list[str]:
    """Images from a registry instead of the ones hack/cluster imports: the flags
    hack/push-images prints (docs/images.md), e.g. "--set init.image.repository=..."."""
    return shlex.split(os.environ.get("HERMIT_E2E_HELM_SET", ""))


@pytest.fixture(scope="session")
def hermit_release(kube: Kube, s3_for_pods: S3, e2e_config: E2EConfig) -> Iterator[str]:
    """The chart installed with S3 credentials in a Secret, and with it this worktree's CRDs
    (adopted first when they exist); the operator on an on-demand node (a spot preemption
    would restart it); removed afterwards (the CRDs stay: crds.keep)."""
    helm = helm_binary()
    env = {**os.environ, "KUBECONFIG": e2e_config.kubeconfig}
    subprocess.run([helm, "uninstall", RELEASE, "-n", RELEASE_NS, "--wait"], env=env,
                   capture_output=True, check=False)
    _adopt_crds()
    try:
        body: Any = {"metadata": {"name": RELEASE_NS}}
        kube.api.create_namespace(body)
    except ApiException as exc:
        if exc.status != 409:
            raise
    _apply_secret(kube, s3_for_pods)
    proc = subprocess.run(
        [helm, "install", RELEASE, str(REPO / "charts/hermit"), "-n", RELEASE_NS,
         *release_values(s3_for_pods), *e2e_images(), "--wait", "--timeout", "180s"],
        env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"helm install failed: {proc.stdout}{proc.stderr}"
    _wait_crds_established()
    try:
        yield RELEASE_NS
    finally:
        subprocess.run([helm, "uninstall", RELEASE, "-n", RELEASE_NS, "--wait"], env=env,
                       capture_output=True, check=False)
