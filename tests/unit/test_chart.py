"""The Helm chart, without helm: values against their schema, CRD copies, env names.

Rendering with ``helm template`` is checked too, with the helm on PATH or in
~/.cache/hermit/bin (hack/install-helm builds it); without one that test fails.
"""

from __future__ import annotations

import re
import subprocess
from typing import Any

import jsonschema
import pytest
import yaml

from hermit_operator import podpolicy
from tests.support.chart import (
    CHART,
    ROOT,
    SCHEMA,
    VALUES,
    WITH_BUCKET,
    Values,
    errors,
    find_helm,
    merged,
)

# AWS S3 needs the role the operator assumes for scoped store credentials.
AWS_ROLE = "s3.scopedCredentials.roleArn=arn:aws:iam::123456789012:role/hermit-store"
SETTINGS_PY = ROOT / "common" / "hermit_common" / "settings.py"


def test_schema_is_a_valid_draft7_schema() -> None:
    jsonschema.Draft7Validator.check_schema(SCHEMA)


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "hermit"
    assert chart["version"] == "0.1.0"
    assert chart["appVersion"] == "0.1.0"


def test_values_with_a_bucket_are_valid() -> None:
    assert errors(WITH_BUCKET) == []


def test_default_values_ask_only_for_the_bucket() -> None:
    problems = errors(VALUES)
    assert problems and all(p.startswith("s3.bucket:") for p in problems), problems


def test_crds_only_install_needs_no_bucket() -> None:
    crds_only = merged(VALUES, {"operator": {"enabled": False}, "nodeAgent": {"enabled": False}})
    assert errors(crds_only) == []


@pytest.mark.parametrize(("override", "where"), [
    ({"cloudProvider": "ibm"}, "cloudProvider"),
    ({"operator": {"image": {"pullPolicy": "Sometimes"}}}, "operator.image.pullPolicy"),
    ({"operator": {"replicas": 2, "leaderElection": {"enabled": False}}},
     "operator.leaderElection.enabled"),
    ({"operator": {"replicas": -1}}, "operator.replicas"),
    ({"nodeAgent": {"awsImdsUrl": "169.254.169.254"}}, "nodeAgent.awsImdsUrl"),
    ({"nodeAgent": {"pollIntervalSeconds": 5}}, "nodeAgent.pollIntervalSeconds"),
    ({"nodeAgent": {"logLevel": "verbose"}}, "nodeAgent.logLevel"),
    ({"nodeAgent": {"uploadBandwidthBytesPerSecond": 1000}},
     "nodeAgent.uploadBandwidthBytesPerSecond"),
    ({"nodeAgent": {"uploadBandwidthBytesPerSecond": -1}},
     "nodeAgent.uploadBandwidthBytesPerSecond"),
    ({"nodeAgent": {"uploadBandwidthBytesPerSecond": "1Gbit"}},
     "nodeAgent.uploadBandwidthBytesPerSecond"),
    ({"nodeAgent": {"hostPaths": {"workDir": "var/lib/hermit"}}}, "nodeAgent.hostPaths.workDir"),
    ({"nodeAgent": {"updateStrategy": "Recreate"}}, "nodeAgent.updateStrategy"),
    ({"operator": {"watchNamespaces": ["Team_A"]}}, "operator.watchNamespaces.0"),
    ({"operator": {"watchNamespaces": ["team-a", "team-a"]}}, "operator.watchNamespaces"),
    ({"operator": {"watchNamespaces": ["n" * 64]}}, "operator.watchNamespaces.0"),
    ({"operator": {"watchNamespaces": "team-a"}}, "operator.watchNamespaces"),
    ({"metrics": {"port": 70000}}, "metrics.port"),
    ({"metrics": {"serviceMonitor": {"enabled": "yes"}}}, "metrics.serviceMonitor.enabled"),
    ({"s3": {"bucket": "Not_A_Bucket"}}, "s3.bucket"),
    ({"s3": {"prefix": "/hermit"}}, "s3.prefix"),
    ({"s3": {"endpoint": "minio:9000"}}, "s3.endpoint"),
    ({"grafana": {"dashboard": {"enabled": "yes"}}}, "grafana.dashboard.enabled"),
    ({"grafana": {"dashboard": {"namespace": "Monitoring"}}}, "grafana.dashboard.namespace"),
    ({"grafana": {"dashboard": {"labels": {"grafana_dashboard": 1}}}},
     "grafana.dashboard.labels.grafana_dashboard"),
    ({"operator": {"podPolicy": {"profile": "privileged"}}}, "operator.podPolicy.profile"),
    ({"operator": {"podPolicy": {"allow": ["everything"]}}}, "operator.podPolicy.allow.0"),
    ({"operator": {"podPolicy": {"serviceAccounts": ["Team_A/agent"]}}},
     "operator.podPolicy.serviceAccounts.0"),
    ({"operator": {"podPolicy": {"secretNamespaces": ["team-a/x"]}}},
     "operator.podPolicy.secretNamespaces.0"),
    ({"nodeAgent": {"sealing": {"kms": {"keyId": "alias/my key"}}}},
     "nodeAgent.sealing.kms.keyId"),
    ({"nodeAgent": {"sealing": {"kms": {"endpoint": "kms:443"}}}},
     "nodeAgent.sealing.kms.endpoint"),
    ({"nodeAgent": {"sealing": {"kms": {"provider": "oci"}}}},
     "nodeAgent.sealing.kms.provider"),
    ({"nodeAgent": {"sealing": {"kms": {"azure": {"wrapAlgorithm": "RSA1_5"}}}}},
     "nodeAgent.sealing.kms.azure.wrapAlgorithm"),
    ({"operatr": {}}, ""),
])
def test_invalid_values_are_rejected(override: Values, where: str) -> None:
    problems = errors(merged(WITH_BUCKET, override))
    assert any(p.startswith(f"{where}:") for p in problems), problems


def _key_lines() -> dict[str, bool]:
    """Dotted path of every mapping key in values.yaml -> whether a comment precedes it."""
    commented: dict[str, bool] = {}
    stack: list[tuple[int, str]] = []
    previous = ""
    for line in (CHART / "values.yaml").read_text().splitlines():
        stripped = line.strip()
        match = re.match(r"^(\s*)([A-Za-z0-9_]+):", line)
        if match:
            indent = len(match.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, match.group(2)))
            commented[".".join(k for _, k in stack)] = previous.startswith("#")
        if stripped:
            previous = stripped
    return commented


def _leaf_paths(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Paths in values whose schema node is a leaf (no declared properties)."""
    if "$ref" in schema:
        schema = SCHEMA["definitions"][schema["$ref"].rsplit("/", 1)[1]]
    props = schema.get("properties")
    if not props or not isinstance(value, dict):
        return [path]
    leaves: list[str] = []
    for key, sub in value.items():
        leaves += _leaf_paths(props[key], sub, f"{path}.{key}" if path else key)
    return leaves


def test_every_value_is_commented() -> None:
    commented = _key_lines()
    leaves = _leaf_paths(SCHEMA, VALUES)
    assert leaves, "no values found"
    uncommented = [p for p in leaves if not commented.get(p, False)]
    assert uncommented == []


def test_the_chart_has_a_crd_template_for_each_crd_of_record_and_no_crds_folder() -> None:
    """crds/ is the API of record; hack/verify --fix makes templates/crds/ from it. A
    crds/ folder in the chart would be installed unowned and never upgraded by Helm."""
    source = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    templates = sorted(p.name for p in (CHART / "templates" / "crds").glob("*.yaml"))
    assert templates == source, "run hack/verify --fix"
    assert not (CHART / "crds").exists(), "run hack/verify --fix"


KEEP = {"helm.sh/resource-policy": "keep"}


def _crds(*sets: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in _render(*sets)
            if d["kind"] == "CustomResourceDefinition"}


def _of_record() -> dict[str, dict[str, Any]]:
    docs = [yaml.safe_load(p.read_text()) for p in sorted((ROOT / "crds").glob("*.yaml"))]
    return {d["metadata"]["name"]: d for d in docs}


def test_the_crds_are_rendered_by_default_as_of_record_and_kept() -> None:
    """`helm upgrade` updates them (Helm never upgrades a chart's crds/ folder), and
    `helm uninstall` keeps them: deleting one deletes every AgentSandbox or Checkpoint."""
    rendered, record = _crds(), _of_record()
    assert sorted(rendered) == sorted(record) == ["agentsandboxes.hermit.dev",
                                                  "checkpoints.hermit.dev"]
    for name, crd in rendered.items():
        assert crd["metadata"].pop("annotations") == KEEP, name
        assert crd["spec"] == record[name]["spec"], name
        assert crd == record[name], name  # nothing else added or lost either


def test_crds_keep_false_renders_them_without_the_keep_annotation() -> None:
    assert _crds("crds.keep=false") == _of_record()


def test_crds_enabled_false_renders_no_crd() -> None:
    assert _crds("crds.enabled=false") == {}
    assert _crds("crds.enabled=false", "crds.keep=false") == {}
    assert errors(merged(WITH_BUCKET, {"crds": {"enabled": "yes"}}))
    assert errors(merged(WITH_BUCKET, {"crds": {"keep": None}}))


def test_without_crds_values_the_crds_are_rendered_and_kept() -> None:
    """`helm upgrade --reuse-values` from a release of an older chart reuses that chart's
    values, which have no crds: the CRDs are still upgraded and kept."""
    rendered = _crds("crds=null")
    assert sorted(rendered) == sorted(_of_record())
    assert all(c["metadata"]["annotations"] == KEEP for c in rendered.values())


# Variables the chart sets that no settings class reads: identity from the downward API
# and the operator's leader election (its settings are not in hermit_common yet).
def test_chart_env_names_are_read_by_the_settings() -> None:
    templates = "\n".join(p.read_text() for p in (CHART / "templates").rglob("*")
                          if p.is_file())
    in_chart = set(re.findall(r"name: (HERMIT_[A-Z0-9_]+)", templates))
    in_settings = set(re.findall(r'"(HERMIT_[A-Z0-9_]+)"', SETTINGS_PY.read_text()))
    assert in_chart <= in_settings, sorted(in_chart - in_settings)
    # What the node-agent cannot start without.
    assert {"HERMIT_NODE_NAME", "HERMIT_S3_BUCKET"} <= in_chart


def test_helm_template_renders() -> None:
    helm = find_helm()
    if helm is None:
        pytest.fail("no helm binary on PATH or in ~/.cache/hermit/bin: run hack/install-helm")
    out = subprocess.run(
        [helm, "template", "hermit", str(CHART), "--namespace", "hermit-system",
         "--set", "s3.bucket=checkpoints", "--set",
         AWS_ROLE, "--set", "metrics.serviceMonitor.enabled=true"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(out) if d)
    assert kinds == sorted([
        # operator, node-agent, turn-client (bound to nothing: docs/turns.md)
        "ClusterRole", "ClusterRole", "ClusterRole", "ClusterRoleBinding", "ClusterRoleBinding",
        "DaemonSet", "Deployment", "Role", "RoleBinding", "Service", "Service",
        # the key service's Service (its Secrets are the hook Job's, docs/security.md)
        "Service",
        # the ensure-secrets hook: its Job, account and Role (no Secret is rendered)
        "Job", "ServiceAccount", "Role", "RoleBinding",
        "ServiceAccount", "ServiceAccount", "ServiceMonitor", "ServiceMonitor",
        # the node-agent's node, pod and checkpoint scopes; the operator's verified mark
        *["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"] * 4,
        # AgentSandbox and Checkpoint (crds.enabled)
        "CustomResourceDefinition", "CustomResourceDefinition",
    ])
    missing = subprocess.run(
        [helm, "template", "hermit", str(CHART)], capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "s3/bucket" in missing.stderr, missing.stderr


def _render(*sets: str) -> list[dict[str, Any]]:
    helm = find_helm()
    if helm is None:
        pytest.fail("no helm binary on PATH or in ~/.cache/hermit/bin: run hack/install-helm")
    args = [a for s in ("s3.bucket=checkpoints",
                                 AWS_ROLE, *sets) for a in ("--set", s)]
    out = subprocess.run([helm, "template", "hermit", str(CHART), *args], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _node_agent_parts(*sets: str) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The node-agent ClusterRole's rules and its container's env, rendered with ``sets``."""
    docs = _render(*sets)
    [role] = [d for d in docs if d["kind"] == "ClusterRole"
              and d["metadata"]["name"].endswith("node-agent")]
    [ds] = [d for d in docs if d["kind"] == "DaemonSet"]
    env = {e["name"]: e.get("value", "") for e in
           ds["spec"]["template"]["spec"]["containers"][0]["env"]}
    return role["rules"], env


def test_per_sandbox_storage_gives_the_node_agent_no_secret_and_the_operator_get_per_namespace(
        ) -> None:
    """docs/storage.md#per-sandbox-store-credentials: the node-agent never reads a Secret
    (no rule anywhere); the operator's key service `get`s them in the listed namespaces."""
    rules, env = _node_agent_parts()
    assert not any("secrets" in r["resources"] for r in rules)
    assert env["HERMIT_PER_SANDBOX_STORAGE"] == "false"
    assert not [d for d in _render() if "storage-secrets" in d["metadata"]["name"]]
    on = ("nodeAgent.perSandboxStorage=true",
          "nodeAgent.perSandboxStorageNamespaces={team-a,team-b}")
    rules_on, env_on = _node_agent_parts(*on)
    assert rules_on == rules  # never cluster-wide: the ClusterRole has no Secret rule
    assert env_on["HERMIT_PER_SANDBOX_STORAGE"] == "true"
    docs = _render(*on)
    agent_sa = {"kind": "ServiceAccount", "name": "hermit-node-agent", "namespace": "default"}
    for doc in docs:  # no Role or binding anywhere gives the node-agent a Secret
        if doc["kind"] in ("RoleBinding", "ClusterRoleBinding") \
                and agent_sa in doc.get("subjects", []):
            [role] = [d for d in docs if d["kind"] == doc["roleRef"]["kind"]
                      and d["metadata"]["name"] == doc["roleRef"]["name"]
                      and d["metadata"].get("namespace") == doc["metadata"].get("namespace")]
            assert not any("secrets" in r["resources"] for r in role["rules"]), role
    granted = [(d["kind"], d["metadata"]["namespace"]) for d in docs
               if d["metadata"]["name"] == "hermit-operator-storage-secrets"]
    assert sorted(granted) == [("Role", "team-a"), ("Role", "team-b"),
                               ("RoleBinding", "team-a"), ("RoleBinding", "team-b")]
    for doc in docs:
        if doc["kind"] == "Role" and doc["metadata"]["name"].endswith("storage-secrets"):
            assert doc["rules"] == [{"apiGroups": [""], "resources": ["secrets"],
                                     "verbs": ["get"]}]
        if doc["kind"] == "RoleBinding" and doc["metadata"]["name"].endswith("storage-secrets"):
            assert doc["subjects"] == [{"kind": "ServiceAccount", "name": "hermit-operator",
                                        "namespace": "default"}]
    [op] = [d for d in docs if d["kind"] == "Deployment"
            and d["metadata"]["name"] == "hermit-operator"]
    op_env = {e["name"]: e.get("value", "") for e in
              op["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert op_env["HERMIT_KEY_SERVICE_SANDBOX_STORE_CREDENTIALS"] == "sts"
    assert "HERMIT_KEY_SERVICE_SANDBOX_STORE_CREDENTIALS" not in {
        e["name"] for d in _render() if d["kind"] == "Deployment"
        for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
    static = _render(*on, "nodeAgent.perSandboxStoreCredentials=static")
    [op] = [d for d in static if d["kind"] == "Deployment"
            and d["metadata"]["name"] == "hermit-operator"]
    assert {"name": "HERMIT_KEY_SERVICE_SANDBOX_STORE_CREDENTIALS", "value": "static"} in \
        op["spec"]["template"]["spec"]["containers"][0]["env"]
    assert errors({"s3": {"bucket": "b"}, "nodeAgent": {
        "perSandboxStoreCredentials": "always"}})
    # The key service calls the store's STS: the operator reaches the S3 port, even with
    # the shared fallback (no scoped credentials for the default store).
    for extra in ((), ("s3.sharedNodeCredentials=true",)):
        [np] = [d for d in _render(*on, "networkPolicy.enabled=true",
                                   "s3.endpoint=http://minio.minio:9000", *extra)
                if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "hermit-operator"]
        assert any(r["ports"][0]["port"] == 9000 for r in np["spec"]["egress"]), extra


def test_per_sandbox_storage_needs_its_namespaces() -> None:
    helm = find_helm()
    if helm is None:
        pytest.fail("no helm binary on PATH or in ~/.cache/hermit/bin: run hack/install-helm")
    proc = subprocess.run([helm, "template", "hermit", str(CHART), "--set",
                           "s3.bucket=checkpoints", "--set", "nodeAgent.perSandboxStorage=true",
                           "--set", AWS_ROLE],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "nodeAgent.perSandboxStorage=true needs nodeAgent.perSandboxStorageNamespaces" \
        in proc.stderr
    assert errors({"s3": {"bucket": "b"}, "nodeAgent": {
        "perSandboxStorageNamespaces": ["Team_A"]}})


def test_per_sandbox_storage_needs_the_key_service_and_watched_namespaces() -> None:
    helm = find_helm()
    if helm is None:
        pytest.fail("no helm binary on PATH or in ~/.cache/hermit/bin: run hack/install-helm")
    on = ["--set", "s3.bucket=checkpoints", "--set", AWS_ROLE, "--set",
          "nodeAgent.perSandboxStorage=true", "--set",
          "nodeAgent.perSandboxStorageNamespaces={team-a}"]
    for extra, message in (
            (["nodeAgent.sealing.keyService.enabled=false"],
             "nodeAgent.perSandboxStorage=true needs the key service"),
            (["operator.watchNamespaces={team-b}"],
             "nodeAgent.perSandboxStorageNamespaces names team-a, which "
             "operator.watchNamespaces does not")):
        proc = subprocess.run([helm, "template", "hermit", str(CHART), *on,
                               *[a for x in extra for a in ("--set", x)]],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr


REVIEWS = [{"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
            "verbs": ["create"]},
           {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"],
            "verbs": ["create"]}]


def test_the_turn_endpoint_is_on_by_default_and_port_0_removes_it_and_its_rights() -> None:
    rules, env = _node_agent_parts()
    assert all(r in rules for r in REVIEWS)
    assert env["HERMIT_TURN_PORT"] == "9103"
    assert env["HERMIT_TURN_AUDIENCE"] == "hermit.dev/turns"
    assert "HERMIT_TURN_TLS_CERT_FILE" not in env
    _, env_aud = _node_agent_parts("nodeAgent.turns.audience=hermit-turns")
    assert env_aud["HERMIT_TURN_AUDIENCE"] == "hermit-turns"
    _, env_tls = _node_agent_parts("nodeAgent.turns.tls.secretName=turns-cert")
    assert env_tls["HERMIT_TURN_TLS_CERT_FILE"] == "/etc/hermit/turns-tls/tls.crt"
    [ds] = [d for d in _render("nodeAgent.turns.tls.secretName=turns-cert")
            if d["kind"] == "DaemonSet"]
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert volumes["turns-tls"]["secret"]["secretName"] == "turns-cert"
    rules_off, env_off = _node_agent_parts("nodeAgent.turns.port=0")
    assert not any(r in rules_off for r in REVIEWS)
    assert env_off["HERMIT_TURN_PORT"] == "0"


def test_the_node_agents_roll_node_by_node_by_default_or_on_delete() -> None:
    """nodeAgent.updateStrategy: RollingUpdate with maxUnavailable, or OnDelete (a team
    rolls the node-agents out itself; the upgrade e2e test does, node by node)."""
    def strategy(*sets: str) -> dict[str, Any]:
        ds = next(d for d in _render(*sets) if d["kind"] == "DaemonSet")
        return dict(ds["spec"]["updateStrategy"])

    assert strategy() == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}
    assert strategy("nodeAgent.maxUnavailable=2")["rollingUpdate"] == {"maxUnavailable": 2}
    assert strategy("nodeAgent.updateStrategy=OnDelete") == {"type": "OnDelete"}


def test_upload_bandwidth_is_unlimited_by_default_and_rendered_as_an_integer() -> None:
    env = "HERMIT_UPLOAD_BANDWIDTH_BYTES_PER_SECOND"
    assert _node_agent_parts()[1][env] == "0"
    # Large numbers from values files reach the template as floats: never 6.25e+07.
    assert _node_agent_parts(
        "nodeAgent.uploadBandwidthBytesPerSecond=62500000")[1][env] == "62500000"
    assert errors(merged(WITH_BUCKET, {"nodeAgent": {
        "uploadBandwidthBytesPerSecond": 62500000}})) == []


def test_lazy_restore_is_off_by_default_and_the_value_turns_it_on() -> None:
    assert _node_agent_parts()[1]["HERMIT_LAZY_RESTORE"] == "false"
    assert _node_agent_parts("nodeAgent.lazyRestore=true")[1]["HERMIT_LAZY_RESTORE"] == "true"


def test_the_chunk_cache_is_two_gib_by_default_and_the_value_sets_it() -> None:
    assert _node_agent_parts()[1]["HERMIT_CHUNK_CACHE_BYTES"] == "0"
    assert _node_agent_parts("nodeAgent.chunkCacheBytes=2147483648")[1][
        "HERMIT_CHUNK_CACHE_BYTES"] == str(2 * 1024 ** 3)


def test_the_turn_port_is_on_the_node_and_the_client_role_is_narrow() -> None:
    helm = find_helm()
    if helm is None:
        pytest.fail("no helm binary on PATH or in ~/.cache/hermit/bin: run hack/install-helm")
    out = subprocess.run([helm, "template", "hermit", str(CHART), "--set",
                          "s3.bucket=checkpoints", "--set",
                          AWS_ROLE], check=True, capture_output=True, text=True,
                         timeout=60).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    [ds] = [d for d in docs if d["kind"] == "DaemonSet"]
    ports = ds["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert {"name": "turns", "containerPort": 9103, "hostPort": 9103,
            "protocol": "TCP"} in ports
    [client] = [d for d in docs if d["kind"] == "ClusterRole"
                and d["metadata"]["name"] == "hermit-turn-client"]
    assert client["rules"] == [
        {"apiGroups": ["hermit.dev"], "resources": ["agentsandboxes/turns"],
         "verbs": ["create"]},
        {"apiGroups": ["hermit.dev"], "resources": ["agentsandboxes"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]


def _operator_env(*sets: str) -> dict[str, str]:
    [deploy] = [d for d in _render(*sets) if d["kind"] == "Deployment"]
    return {e["name"]: e.get("value", "") for e in
            deploy["spec"]["template"]["spec"]["containers"][0]["env"]}


def _operator_rbac(*sets: str) -> tuple[list[dict[str, Any]],
                                         dict[tuple[str, str], list[Any]]]:
    """The operator ClusterRole's rules, and the rules of each Role bound to the operator
    by (namespace, name) (its Lease Role included), rendered with ``sets``."""
    docs = _render(*sets)
    [cluster_role] = [d for d in docs if d["kind"] == "ClusterRole"
                      and d["metadata"]["name"] == "hermit-operator"]
    bound = {(d["metadata"]["namespace"], d["roleRef"]["name"]) for d in docs
             if d["kind"] == "RoleBinding" and d["subjects"] == [
                 {"kind": "ServiceAccount", "name": "hermit-operator", "namespace": "default"}]}
    roles = {(d["metadata"]["namespace"], d["metadata"]["name"]): d["rules"] for d in docs
             if d["kind"] == "Role"
             and (d["metadata"]["namespace"], d["metadata"]["name"]) in bound}
    return cluster_role["rules"], roles


LEASES = [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
           "verbs": ["get", "create", "update"]}]
LEASE_ROLE = ("default", "hermit-operator")
CLUSTER_SCOPED = {"tokenreviews", "customresourcedefinitions", "namespaces"}


def test_the_operator_watches_every_namespace_by_default() -> None:
    rules, roles = _operator_rbac()
    assert {r for rule in rules for r in rule["resources"]} == CLUSTER_SCOPED | {
        "agentsandboxes", "checkpoints", "agentsandboxes/status", "checkpoints/status",
        "agentsandboxes/finalizers", "pods", "poddisruptionbudgets", "events"}
    assert roles == {LEASE_ROLE: LEASES}
    assert "HERMIT_WATCH_NAMESPACE" not in _operator_env()
    assert not [d for d in _render() if d["metadata"]["name"].endswith("-watch")]


def test_watch_namespaces_move_the_namespaced_rules_to_a_role_in_each() -> None:
    """operator.watchNamespaces (issue 21): the same rules, the namespaced ones granted
    in each watched namespace only; the ClusterRole keeps the cluster-scoped ones."""
    everywhere, _ = _operator_rbac()
    watch = "operator.watchNamespaces={team-a,team-b}"
    rules, roles = _operator_rbac(watch)
    assert {r for rule in rules for r in rule["resources"]} == CLUSTER_SCOPED
    namespaced = [r for r in everywhere if r not in rules]
    assert namespaced + rules == everywhere
    assert roles == {LEASE_ROLE: LEASES, ("team-a", "hermit-operator-watch"): namespaced,
                     ("team-b", "hermit-operator-watch"): namespaced}
    assert _operator_env(watch)["HERMIT_WATCH_NAMESPACE"] == "team-a,team-b"
    # The release namespace may be one of them: its Lease Role keeps its own name.
    assert _operator_rbac("operator.watchNamespaces={default}")[1] == {
        LEASE_ROLE: LEASES, ("default", "hermit-operator-watch"): namespaced}
    # Without the key service the ClusterRole still lets kopf discover CRDs and namespaces.
    rules, _ = _operator_rbac(watch, "nodeAgent.sealing.keyService.enabled=false")
    assert {r for rule in rules for r in rule["resources"]} == {
        "customresourcedefinitions", "namespaces"}
    # The node-agent is not confined: it must see every sandbox pod on its node.
    assert _node_agent_parts(watch)[0] == _node_agent_parts()[0]


def test_the_pod_policy_is_restricted_by_default_and_each_exemption_is_a_value() -> None:
    env = _operator_env()
    assert env["HERMIT_POD_POLICY_PROFILE"] == "restricted"
    for name in ("HERMIT_POD_POLICY_ALLOW", "HERMIT_POD_POLICY_CAPABILITIES",
                 "HERMIT_POD_POLICY_SERVICE_ACCOUNTS", "HERMIT_POD_POLICY_SECRET_NAMESPACES"):
        assert env[name] == "", name
    env = _operator_env("operator.podPolicy.profile=baseline",
                        "operator.podPolicy.allow={placement,hostPath}",
                        "operator.podPolicy.serviceAccounts={agent,team-a/deployer}",
                        "operator.podPolicy.secretNamespaces={team-a}")
    assert env["HERMIT_POD_POLICY_PROFILE"] == "baseline"
    assert env["HERMIT_POD_POLICY_ALLOW"] == "placement,hostPath"
    assert env["HERMIT_POD_POLICY_SERVICE_ACCOUNTS"] == "agent,team-a/deployer"
    assert env["HERMIT_POD_POLICY_SECRET_NAMESPACES"] == "team-a"


# -- the node-agent's writes (node-agent-policy.yaml; docs/protocol.md) ---------------------

def _policies(*sets: str) -> dict[str, dict[str, Any]]:
    """The ValidatingAdmissionPolicies by name (their bindings are named alike)."""
    return {d["metadata"]["name"]: d for d in _render(*sets)
            if d["kind"] == "ValidatingAdmissionPolicy"}


def _cel_strings(expression: str) -> list[str]:
    """The string literals of a CEL expression, in order."""
    return [a or b for a, b in re.findall(r"'([^']*)'|\"([^\"]*)\"", expression)]


def test_the_node_agent_policies_hold_the_protocols_own_vocabulary() -> None:
    from hermit_common import protocol

    policies = _policies()
    scopes = {s: policies[f"hermit-node-agent-{s}-scope"]["spec"]
              for s in ("node", "pod", "checkpoint")}
    resources = {s: {r for rule in spec["matchConstraints"]["resourceRules"]
                     for r in rule["resources"]} for s, spec in scopes.items()}
    # one kind each (type-checked against its own schema), every subresource too: a
    # node-agent writes no Node or pod status, eviction, binding, ...
    assert resources == {"node": {"nodes", "nodes/*"}, "pod": {"pods", "pods/*"},
                         "checkpoint": {"checkpoints", "checkpoints/*"}}
    for spec in scopes.values():
        assert spec["failurePolicy"] == "Fail"
        assert spec["matchConditions"] == [{
            "name": "node-agent",
            "expression": 'request.userInfo.username == '
                          '"system:serviceaccount:default:hermit-node-agent"'}]
    variables = {s: {v["name"]: v["expression"] for v in spec["variables"]}
                 for s, spec in scopes.items()}
    assert _cel_strings(variables["pod"]["podAnnotations"]) == \
        list(protocol.NODE_AGENT_POD_ANNOTATIONS)
    assert _cel_strings(variables["node"]["taint"]) == [protocol.TAINT_INTERRUPTION]
    text = {s: "\n".join(v["expression"] for v in spec["validations"])
            for s, spec in scopes.items()}
    assert f'matches("{protocol.NODE_AGENT_CHECKPOINT_NAMES}")' in text["checkpoint"]
    [reasons] = re.findall(r"object\.spec\.reason in \[([^\]]*)\]", text["checkpoint"])
    assert _cel_strings(reasons) == list(protocol.NODE_AGENT_REASONS)
    assert f"'{protocol.ANNOTATION_NODE_VERIFIED}'" in text["checkpoint"]
    assert f"'{protocol.LABEL_NODE}'" in text["checkpoint"]
    messages = {s: " ".join(v.get("message") or v.get("messageExpression") or ""
                            for v in spec["validations"]) for s, spec in scopes.items()}
    for scope, says in [
            ("node", "deletes nothing"), ("node", "never creates a Node"),
            ("node", "never its labels, annotations"),
            ("node", "never another taint or spec field"),
            ("pod", "deletes nothing"), ("pod", "only annotates pods"),
            ("pod", "never its spec"), ("pod", "labels, owners or finalizers"),
            ("pod", "the pod annotations it reports a restore with"),
            ("checkpoint", "deletes nothing"),
            ("checkpoint", "only Checkpoints labelled hermit.dev/node="),
            ("checkpoint", "never changes their metadata"),
            ("checkpoint", "only the operator marks"),
            ("checkpoint", "under the names the protocol gives them"),
            ("checkpoint", "no owner references or finalizers")]:
        assert says in messages[scope], (scope, says)
    bindings = {d["spec"]["policyName"]: d["spec"]["validationActions"] for d in _render()
                if d["kind"] == "ValidatingAdmissionPolicyBinding"}
    assert bindings == {"hermit-node-agent-node-scope": ["Deny"],
                        "hermit-node-agent-pod-scope": ["Deny"],
                        "hermit-node-agent-checkpoint-scope": ["Deny"],
                        "hermit-checkpoint-trust": ["Deny"]}


def test_only_the_operator_may_mark_a_checkpoint_verified() -> None:
    from hermit_common import protocol

    policy = _policies()["hermit-checkpoint-trust"]
    spec = policy["spec"]
    assert spec["matchConstraints"]["resourceRules"] == [{
        "apiGroups": ["hermit.dev"], "apiVersions": ["*"], "operations": ["CREATE", "UPDATE"],
        "resources": ["checkpoints"]}]
    assert spec["matchConditions"] == [{
        "name": "not-the-operator",
        "expression": 'request.userInfo.username != '
                      '"system:serviceaccount:default:hermit-operator"'}]
    variables = {v["name"]: v["expression"] for v in spec["variables"]}
    assert _cel_strings(variables["mark"]) == [protocol.ANNOTATION_NODE_VERIFIED]
    # the node scope is a value of its own; the mark is guarded whenever the operator runs
    off = _policies("nodeAgent.nodeScopedPolicy=false")
    assert "hermit-node-agent-node-scope" not in off and "hermit-checkpoint-trust" in off
    assert "hermit-checkpoint-trust" not in _policies("operator.enabled=false")


def _key_service_parts(*sets: str) -> dict[str, Any]:
    docs = _render(*sets)
    [ds] = [d for d in docs if d["kind"] == "DaemonSet"]
    [dep] = [d for d in docs if d["kind"] == "Deployment"]
    [op_role] = [d for d in docs if d["kind"] == "ClusterRole"
                 if d["metadata"]["name"].endswith("-operator")]

    def env(obj: dict[str, Any]) -> dict[str, str]:
        return {e["name"]: e.get("value", "")
                for e in obj["spec"]["template"]["spec"]["containers"][0]["env"]}

    def volumes(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {v["name"]: v for v in obj["spec"]["template"]["spec"]["volumes"]}

    return {"docs": docs, "agent_env": env(ds), "agent_volumes": volumes(ds),
            "op_env": env(dep), "op_volumes": volumes(dep), "op_rules": op_role["rules"]}


def test_with_the_key_service_only_the_operator_mounts_the_sealing_secret() -> None:
    on = _key_service_parts("nodeAgent.sealing.keyService.enabled=true",
                            "networkPolicy.enabled=true")
    secrets = {v["secret"]["secretName"] for v in on["agent_volumes"].values()
               if "secret" in v}
    assert secrets == {"hermit-keys-trust"}, "the node-agent mounts the CA, no key"
    assert "HERMIT_SEAL_KEYS_DIR" not in on["agent_env"]
    assert on["agent_env"]["HERMIT_SEAL_KEY_SERVICE_URL"] == \
        "https://hermit-keys.default.svc:9443"
    [token] = on["agent_volumes"]["keys-token"]["projected"]["sources"]
    assert token["serviceAccountToken"]["audience"] == "hermit.dev/keys"
    assert on["op_volumes"]["sealing-keys"]["secret"]["secretName"] == "hermit-sealing"
    # The operator runs as 65532: its Secret volumes are its group's.
    [dep] = [d for d in on["docs"] if d["kind"] == "Deployment"]
    assert dep["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == 65532
    assert {on["op_volumes"][v]["secret"]["defaultMode"]
            for v in ("sealing-keys", "keys-tls")} == {0o440}
    assert on["op_env"]["HERMIT_KEY_SERVICE_CALLERS"] == \
        "system:serviceaccount:default:hermit-node-agent"
    assert {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
            "verbs": ["create"]} in on["op_rules"]
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in on["docs"]}
    assert on["op_volumes"]["keys-tls"]["secret"]["secretName"] == "hermit-keys-serving"
    [job] = [d for d in on["docs"] if d["kind"] == "Job"]
    assert {"--serving=hermit-keys-serving", "--trust=hermit-keys-trust",
            "--service=hermit-keys", "--sealing=hermit-sealing"} <= set(
        job["spec"]["template"]["spec"]["containers"][0]["args"])
    assert by_name[("Service", "hermit-keys")]["spec"]["ports"][0]["targetPort"] == "keys"
    # The operator accepts the key port from node-agents only; node-agents reach it.
    op_np = by_name[("NetworkPolicy", "hermit-operator")]["spec"]
    [keys_in] = [r for r in op_np["ingress"] if r["ports"][0]["port"] == "keys"]
    assert keys_in["from"][0]["podSelector"]["matchLabels"][
        "app.kubernetes.io/component"] == "node-agent"
    agent_np = by_name[("NetworkPolicy", "hermit-node-agent")]["spec"]
    assert any(r["ports"][0]["port"] == 9443 and r["to"][0]["podSelector"]["matchLabels"][
        "app.kubernetes.io/component"] == "operator" for r in agent_np["egress"])

    links = _key_service_parts("nodeAgent.sealing.keyService.serviceLinks=true")
    assert links["agent_env"]["HERMIT_SEAL_KEY_SERVICE_URL"] == \
        "https://$(HERMIT_KEYS_SERVICE_HOST):9443"
    assert links["agent_env"]["HERMIT_SEAL_KEY_SERVICE_SERVER_NAME"] == "hermit-keys.default.svc"

    off = _key_service_parts("nodeAgent.sealing.keyService.enabled=false")
    assert off["agent_env"]["HERMIT_SEAL_KEYS_DIR"] == "/etc/hermit/sealing"
    assert "HERMIT_SEAL_KEY_SERVICE_URL" not in off["agent_env"]
    assert "sealing-keys" not in off["op_volumes"]
    assert not any("tokenreviews" in r["resources"] for r in off["op_rules"])
    assert not [d for d in off["docs"] if d["metadata"]["name"].startswith("hermit-keys")]


def test_with_kms_the_operator_asks_aws_kms_and_no_pod_mounts_a_kek() -> None:
    kms = _key_service_parts("nodeAgent.sealing.kms.keyId=alias/hermit",
                             "nodeAgent.sealing.kms.macKeyId=alias/hermit-mac",
                             "nodeAgent.sealing.kms.region=eu-west-2")
    assert {k: v for k, v in kms["op_env"].items() if k.startswith("HERMIT_SEAL_")} == {
        "HERMIT_SEAL_KMS_KEY_ID": "alias/hermit", "HERMIT_SEAL_KMS_MAC_KEY_ID": "alias/hermit-mac",
        "HERMIT_SEAL_KMS_REGION": "eu-west-2"}
    assert "sealing-keys" not in kms["op_volumes"] and "keys-tls" in kms["op_volumes"]
    assert "sealing-keys" not in kms["agent_volumes"]
    assert "HERMIT_SEAL_KEY_SERVICE_URL" in kms["agent_env"]
    # No sealing Secret is generated: the hook Job makes the key service's TLS only.
    [job] = [d for d in kms["docs"] if d["kind"] == "Job"]
    assert not [a for a in job["spec"]["template"]["spec"]["containers"][0]["args"]
                if a.startswith("--sealing")]
    endpoint = _key_service_parts("nodeAgent.sealing.kms.keyId=k", "networkPolicy.enabled=true",
                                  "nodeAgent.sealing.kms.endpoint=https://kms.vpce.example:8443")
    assert endpoint["op_env"]["HERMIT_SEAL_KMS_ENDPOINT"] == "https://kms.vpce.example:8443"
    # The operator's NetworkPolicy lets it reach KMS (443 for AWS's own endpoint).
    [op_np] = [d for d in endpoint["docs"] if d["kind"] == "NetworkPolicy"
               and d["metadata"]["name"] == "hermit-operator"]
    assert {"port": 8443, "protocol": "TCP"} in [
        p for r in op_np["spec"]["egress"] for p in r["ports"]]
    # Node-agents do not call KMS: without the key service the chart refuses.
    helm = find_helm()
    assert helm, "helm not found: run hack/install-helm"
    off = subprocess.run([helm, "template", "hermit", str(CHART),
                          "--set", "s3.bucket=checkpoints", "--set", AWS_ROLE,
                          "--set", "nodeAgent.sealing.kms.keyId=k",
                          "--set", "nodeAgent.sealing.keyService.enabled=false"],
                         capture_output=True, text=True, timeout=60)
    assert off.returncode != 0
    assert "nodeAgent.sealing.kms.keyId needs the key service" in off.stderr


def test_with_key_vault_or_cloud_kms_the_operator_gets_its_provider_and_egress() -> None:
    url = "https://hermit.vault.azure.net/keys/kek"
    azure = _key_service_parts("nodeAgent.sealing.kms.provider=azure",
                               f"nodeAgent.sealing.kms.keyId={url}",
                               "networkPolicy.enabled=true")
    assert {k: v for k, v in azure["op_env"].items() if k.startswith("HERMIT_SEAL_")} == {
        "HERMIT_SEAL_KMS_PROVIDER": "azure", "HERMIT_SEAL_KMS_KEY_ID": url,
        "HERMIT_SEAL_KMS_AZURE_WRAP_ALGORITHM": "RSA-OAEP-256"}
    assert "sealing-keys" not in azure["op_volumes"]
    [dep] = [d for d in azure["docs"] if d["kind"] == "Deployment"]
    # The Azure Workload Identity webhook injects AZURE_* into pods with this label.
    assert dep["spec"]["template"]["metadata"]["labels"]["azure.workload.identity/use"] == \
        "true"
    [op_np] = [d for d in azure["docs"] if d["kind"] == "NetworkPolicy"
               and d["metadata"]["name"] == "hermit-operator"]
    assert {"port": 443, "protocol": "TCP"} in [
        p for r in op_np["spec"]["egress"] for p in r["ports"]]
    gcp = _key_service_parts(
        "nodeAgent.sealing.kms.provider=gcp", "networkPolicy.enabled=true",
        "nodeAgent.sealing.kms.keyId=projects/p/locations/l/keyRings/r/cryptoKeys/k")
    assert gcp["op_env"]["HERMIT_SEAL_KMS_PROVIDER"] == "gcp"
    assert "HERMIT_SEAL_KMS_AZURE_WRAP_ALGORITHM" not in gcp["op_env"]
    [dep] = [d for d in gcp["docs"] if d["kind"] == "Deployment"]
    assert "azure.workload.identity/use" not in dep["spec"]["template"]["metadata"]["labels"]
    [op_np] = [d for d in gcp["docs"] if d["kind"] == "NetworkPolicy"
               and d["metadata"]["name"] == "hermit-operator"]
    # GKE's metadata server gives the workload identity's tokens.
    assert {"ports": [{"port": 80, "protocol": "TCP"}],
            "to": [{"ipBlock": {"cidr": "169.254.169.254/32"}}]} in op_np["spec"]["egress"]
    # AWS stays as it was: no provider variable.
    aws = _key_service_parts("nodeAgent.sealing.kms.keyId=alias/hermit")
    assert "HERMIT_SEAL_KMS_PROVIDER" not in aws["op_env"]


def test_with_the_key_service_node_agents_get_no_bucket_credential() -> None:
    """Scoped store credentials (docs/storage.md#scoped-store-credentials) by default:
    only the operator gets s3.existingSecret; s3.sharedNodeCredentials falls back."""
    secret_keys = {"HERMIT_S3_ACCESS_KEY_ID", "HERMIT_S3_SECRET_ACCESS_KEY"}
    on = _key_service_parts("s3.existingSecret=bucket-creds")
    assert not secret_keys & set(on["agent_env"])
    assert on["agent_env"]["HERMIT_S3_SCOPED_CREDENTIALS"] == "true"
    assert secret_keys <= set(on["op_env"])
    assert on["op_env"]["HERMIT_KEY_SERVICE_STORE_CREDENTIALS"] == "true"
    assert on["op_env"]["HERMIT_KEY_SERVICE_STORE_CREDENTIALS_SECONDS"] == "3600"
    assert on["op_env"]["HERMIT_KEY_SERVICE_STORE_ROLE_ARN"] == \
        "arn:aws:iam::123456789012:role/hermit-store"
    for fallback in (("s3.sharedNodeCredentials=true",),
                     ("nodeAgent.sealing.keyService.enabled=false",)):
        shared = _key_service_parts("s3.existingSecret=bucket-creds", *fallback)
        assert secret_keys <= set(shared["agent_env"]), fallback
        assert "HERMIT_S3_SCOPED_CREDENTIALS" not in shared["agent_env"]
        assert "HERMIT_KEY_SERVICE_STORE_CREDENTIALS" not in shared["op_env"]
    # AWS S3 (no endpoint) needs the role to assume; MinIO does not.
    helm = find_helm()
    assert helm, "helm not found: run hack/install-helm"
    aws = subprocess.run([helm, "template", "hermit", str(CHART), "--set",
                          "s3.bucket=checkpoints"], capture_output=True, text=True)
    assert aws.returncode != 0 and "s3.scopedCredentials.roleArn is required" in aws.stderr
    minio = subprocess.run([helm, "template", "hermit", str(CHART), "--set",
                            "s3.bucket=checkpoints", "--set", "s3.endpoint=http://minio:9000"],
                           capture_output=True, text=True)
    assert minio.returncode == 0, minio.stderr
    assert "HERMIT_KEY_SERVICE_STORE_ROLE_ARN" not in minio.stdout


def _operator(*sets: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    docs = _render(*sets)
    [dep] = [d for d in docs if d["kind"] == "Deployment"
             and d["metadata"]["name"].endswith("operator")]
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    return dep["spec"]["template"]["spec"], pdbs


def test_the_operator_stays_off_spot_nodes_and_spreads_when_it_has_standbys() -> None:
    spec, pdbs = _operator()
    [term] = spec["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    excluded = {(e["key"], tuple(e["values"])) for e in term["matchExpressions"]
                if e["operator"] == "NotIn"}
    # Every spot label the sandboxes' placement knows (the operator's own list).
    assert {(k, (v,)) for k, v in podpolicy.SPOT_NODE_LABELS} == excluded
    assert "topologySpreadConstraints" not in spec and pdbs == []  # one replica: no PDB
    key = "operator.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution." \
        "nodeSelectorTerms[0].matchExpressions[0]"
    spec, _ = _operator(f"{key}.key=pool", f"{key}.operator=In", f"{key}.values={{ops}}")
    [term] = spec["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term == {"matchExpressions": [{"key": "pool", "operator": "In",
                                          "values": ["ops"]}]}  # the user's, as given
    spec, _ = _operator("operator.avoidSpot=false")
    assert "affinity" not in spec
    spec, pdbs = _operator("operator.replicas=2")
    assert {c["topologyKey"] for c in spec["topologySpreadConstraints"]} == {
        "kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    [pdb] = pdbs
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"


def test_the_node_agent_runs_on_linux_nodes_of_the_built_architectures_only() -> None:
    def terms(*sets: str) -> list[dict[str, Any]]:
        [ds] = [d for d in _render(*sets) if d["kind"] == "DaemonSet"]
        affinity = ds["spec"]["template"]["spec"].get("affinity") or {}
        return list((affinity.get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms")
            or [])

    [term] = terms()
    required = {e["key"]: (e["operator"], e["values"]) for e in term["matchExpressions"]}
    assert required["kubernetes.io/os"] == ("In", ["linux"])
    assert required["kubernetes.io/arch"] == ("In", ["amd64"])
    assert required["eks.amazonaws.com/compute-type"] == ("NotIn", ["fargate"])
    [term] = terms("nodeAgent.architectures={amd64,arm64}")
    assert {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64", "arm64"]} \
        in term["matchExpressions"]
    key = "nodeAgent.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution." \
        "nodeSelectorTerms[0].matchExpressions[0]"
    [term] = terms(f"{key}.key=pool", f"{key}.operator=Exists")
    assert term == {"matchExpressions": [{"key": "pool", "operator": "Exists"}]}


def test_sandbox_pods_require_a_ready_node_agent_unless_turned_off() -> None:
    assert _operator_env()["HERMIT_REQUIRE_READY_NODE_AGENT"] == "true"
    assert _operator_env("sandboxes.requireReadyNodeAgent=false")[
        "HERMIT_REQUIRE_READY_NODE_AGENT"] == "false"
    with pytest.raises(subprocess.CalledProcessError):
        _render("sandboxes.requireReadyNodeAgent=maybe")


def test_the_chart_renders_no_key_so_every_render_is_the_same() -> None:
    """GitOps: `helm template` (Argo CD, Flux) must not make a new sealing key or CA on
    each sync. The chart renders no Secret; the hook Job creates the missing ones."""
    first = _render()
    assert first == _render()
    assert not [d for d in first if d["kind"] == "Secret"]
    [job] = [d for d in first if d["kind"] == "Job"]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    # Its account, Role and binding exist before it (hooks run before the release's objects).
    weights = {d["kind"]: int(d["metadata"]["annotations"]["helm.sh/hook-weight"])
               for d in first if "helm.sh/hook" in d["metadata"].get("annotations", {})}
    assert weights == {"ServiceAccount": -10, "Role": -10, "RoleBinding": -10, "Job": 0}
    [role] = [d for d in first if d["kind"] == "Role"
              and d["metadata"]["name"] == "hermit-ensure-secrets"]
    named = [r for r in role["rules"] if "resourceNames" in r]
    assert named == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "patch"],
                      "resourceNames": ["hermit-sealing", "hermit-keys-serving",
                                        "hermit-keys-trust"]}]
    # A Secret of the user's own: the Job does not manage it; the Job can be switched off.
    own = _render("nodeAgent.sealing.existingSecret=mine")
    [job] = [d for d in own if d["kind"] == "Job"]
    assert not any(a.startswith("--sealing") for a in
                   job["spec"]["template"]["spec"]["containers"][0]["args"])
    assert not [d for d in _render("secretsJob.enabled=false") if d["kind"] == "Job"]


def test_values_platform_teams_expect() -> None:
    """Registry mirror and digests, pod labels and security context, extra volumes (a
    private CA for S3), ServiceMonitor relabelings (issue 21, point 6)."""
    digest = "sha256:" + "a" * 64
    docs = _render(
        "global.imageRegistry=mirror.example.com:5000/hub",
        f"operator.image.digest={digest}",
        "operator.podLabels.team=platform", "nodeAgent.podLabels.team=platform",
        "operator.podSecurityContext.runAsUser=1001",
        "nodeAgent.podSecurityContext.supplementalGroups={5}",
        "operator.extraVolumes[0].name=s3-ca",
        "operator.extraVolumes[0].configMap.name=corp-ca",
        "operator.extraVolumeMounts[0].name=s3-ca",
        "operator.extraVolumeMounts[0].mountPath=/etc/corp-ca",
        "nodeAgent.extraVolumes[0].name=s3-ca",
        "nodeAgent.extraVolumes[0].configMap.name=corp-ca",
        "nodeAgent.extraVolumeMounts[0].name=s3-ca",
        "nodeAgent.extraVolumeMounts[0].mountPath=/etc/corp-ca",
        "metrics.serviceMonitor.enabled=true",
        "metrics.serviceMonitor.relabelings[0].targetLabel=cluster",
        "metrics.serviceMonitor.relabelings[0].replacement=prod",
        "metrics.serviceMonitor.metricRelabelings[0].action=drop",
        "metrics.serviceMonitor.metricRelabelings[0].sourceLabels={__name__}",
        "metrics.serviceMonitor.metricRelabelings[0].regex=go_.*")
    [dep] = [d for d in docs if d["kind"] == "Deployment"]
    [ds] = [d for d in docs if d["kind"] == "DaemonSet"]
    op, agent = dep["spec"]["template"], ds["spec"]["template"]
    op_c, agent_c = op["spec"]["containers"][0], agent["spec"]["containers"][0]
    assert op_c["image"] == f"mirror.example.com:5000/hub/hermit/operator@{digest}"
    assert agent_c["image"] == "mirror.example.com:5000/hub/hermit/node-agent:0.1.0"
    # The init image sandbox pods copy hermit-init from follows the same override.
    env = {e["name"]: e.get("value") for e in op_c["env"]}
    assert env["HERMIT_INIT_IMAGE"] == "mirror.example.com:5000/hub/hermit/init:0.1.0"
    for pod in (op, agent):
        assert pod["metadata"]["labels"]["team"] == "platform"
        # Extra labels never replace the selector's.
        assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == "hermit"
    psc = op["spec"]["securityContext"]
    assert psc["runAsUser"] == 1001 and psc["runAsNonRoot"] is True
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert agent["spec"]["securityContext"] == {"supplementalGroups": [5]}
    for pod, c in ((op, op_c), (agent, agent_c)):
        assert {"name": "s3-ca", "configMap": {"name": "corp-ca"}} in pod["spec"]["volumes"]
        assert {"name": "s3-ca", "mountPath": "/etc/corp-ca"} in c["volumeMounts"]
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert len(monitors) == 2
    for m in monitors:
        [ep] = m["spec"]["endpoints"]
        # The node-agent's targets also get their node's name (the dashboard's node variable).
        node = ([{"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"}]
                if m["metadata"]["labels"]["app.kubernetes.io/component"] == "node-agent"
                else [])
        assert ep["relabelings"] == [*node, {"targetLabel": "cluster", "replacement": "prod"}]
        assert ep["metricRelabelings"] == [
            {"action": "drop", "sourceLabels": ["__name__"], "regex": "go_.*"}]
    # Defaults: no registry, tags, the chart's own pod security context.
    [dep] = [d for d in _render() if d["kind"] == "Deployment"]
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "hermit/operator:0.1.0"
    assert dep["spec"]["template"]["spec"]["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532,
        "seccompProfile": {"type": "RuntimeDefault"}}


def test_init_image_is_its_own() -> None:
    """Sandbox pods copy hermit-init from the small init image (init.image), not from the
    node-agent's (issue 21, point 1): a digest pins it, the pull policy reaches the
    operator."""
    env = _operator_env()
    assert env["HERMIT_INIT_IMAGE"] == "hermit/init:0.1.0"
    assert env["HERMIT_INIT_PULL_POLICY"] == "IfNotPresent"
    assert env["HERMIT_INIT_PATH"] == "/usr/local/bin/hermit-init"
    digest = "sha256:" + "b" * 64
    env = _operator_env("init.image.repository=reg.example/hermit/init",
                        f"init.image.digest={digest}", "init.image.pullPolicy=Always",
                        "nodeAgent.image.tag=9.9.9")
    assert env["HERMIT_INIT_IMAGE"] == f"reg.example/hermit/init@{digest}"
    assert env["HERMIT_INIT_PULL_POLICY"] == "Always"
