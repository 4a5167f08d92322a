from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from hermit_common import protocol
from hermit_common.settings import OperatorSettings, PodPolicySettings
from hermit_operator import podspec
from hermit_operator.podspec import InvalidSpec, build_sandbox_pod

SAMPLES = Path(__file__).resolve().parents[2] / "crds" / "samples"
# The placement tests judge Hermit's spot terms alone: the ready node-agent requirement
# (on by default) is added to each term afterwards, tested on its own (READY, below).
SETTINGS = OperatorSettings(init_image="registry.example/hermit:1.0",
                            init_path="/usr/local/bin/hermit-init",
                            require_ready_node_agent=False)
READY = dataclasses.replace(SETTINGS, require_ready_node_agent=True)
# A template's own nodeSelector switches the spot requirement off: the pod policy refuses
# it unless the admin grants the placement exemption (tests/unit/test_podpolicy.py).
PLACEMENT_EXEMPT = dataclasses.replace(
    SETTINGS, pod_policy=PodPolicySettings(allow=frozenset({"placement"})))


# Every pod (with the hold on) is marked held, and may be evicted by the cluster autoscaler
# despite its emptyDirs.
SAFE = {protocol.ANNOTATION_SAFE_TO_EVICT: "true", protocol.ANNOTATION_HOLD: "true"}


def sample(name: str) -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load((SAMPLES / name).read_text())
    obj["metadata"].update(namespace="team-a", uid="uid-1234", generation=1)
    return obj


def test_minimal_sample_runs_under_hermit_init() -> None:
    pod = build_sandbox_pod(sample("agentsandbox-minimal.yaml"), SETTINGS, 1, None)
    meta, spec = pod["metadata"], pod["spec"]
    assert pod["apiVersion"] == "v1" and pod["kind"] == "Pod"
    assert meta["name"] == "minimal-1" and meta["namespace"] == "team-a"
    assert meta["labels"] == {protocol.LABEL_SANDBOX: "minimal", protocol.LABEL_INCARNATION: "1",
                              protocol.LABEL_CAPACITY: "spot"}
    assert meta["annotations"] == {protocol.ANNOTATION_WORKSPACE_PATH: "/workspace", **SAFE}
    assert meta["ownerReferences"] == [{
        "apiVersion": "hermit.dev/v1alpha1", "kind": "AgentSandbox", "name": "minimal",
        "uid": "uid-1234", "controller": True, "blockOwnerDeletion": True}]
    main = spec["containers"][0]
    assert main["command"] == ["/.hermit/hermit-init", "--", "python", "-m", "http.server",
                               "8000"]
    init = spec["initContainers"][0]
    assert init["image"] == "registry.example/hermit:1.0"
    assert init["imagePullPolicy"] == "IfNotPresent"
    assert init["command"] == ["/usr/local/bin/hermit-init", "--install", "/.hermit/hermit-init"]
    assert {"name": "hermit-init", "mountPath": "/.hermit"} in init["volumeMounts"]
    assert {"name": "hermit-init", "mountPath": "/.hermit", "readOnly": True} in main[
        "volumeMounts"]
    assert {"name": "hermit-workspace", "mountPath": "/workspace"} in main["volumeMounts"]
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["hermit-workspace"] == {"name": "hermit-workspace",
                                        "emptyDir": {"sizeLimit": "1Gi"}}
    assert "emptyDir" in vols["hermit-init"]
    assert spec["restartPolicy"] == "Never"
    # Long enough for an evicted pod's Eviction checkpoint (its preStop hook waits for it).
    assert spec["terminationGracePeriodSeconds"] == 120
    assert main["lifecycle"] == {"preStop": {"sleep": {"seconds": 120}}}
    assert "nodeSelector" not in spec
    assert spec["affinity"] == {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [
            {"matchExpressions": [{"key": "karpenter.sh/capacity-type", "operator": "In",
                                   "values": ["spot"]}]},
            {"matchExpressions": [{"key": "eks.amazonaws.com/capacityType", "operator": "In",
                                   "values": ["SPOT"]}]},
            {"matchExpressions": [{"key": "cloud.google.com/gke-spot", "operator": "In",
                                   "values": ["true"]}]},
            {"matchExpressions": [{"key": "cloud.google.com/gke-provisioning", "operator": "In",
                                   "values": ["spot"]}]},
            {"matchExpressions": [{"key": "kubernetes.azure.com/scalesetpriority",
                                   "operator": "In", "values": ["spot"]}]},
        ]}}}
    assert {t["key"] for t in spec["tolerations"]} >= {"kubernetes.azure.com/scalesetpriority",
                                                       "cloud.google.com/gke-spot"}


def test_args_stay_after_the_command() -> None:
    sb = sample("agentsandbox-minimal.yaml")
    sb["spec"]["podTemplate"]["spec"]["containers"][0].update(command=["sh"],
                                                              args=["-c", "echo hi"])
    main = build_sandbox_pod(sb, SETTINGS, 2, None)["spec"]["containers"][0]
    assert main["command"] == ["/.hermit/hermit-init", "--", "sh"]
    assert main["args"] == ["-c", "echo hi"]


def test_restore_mode_waits_for_the_restored_tree_and_annotates() -> None:
    pod = build_sandbox_pod(sample("agentsandbox-minimal.yaml"), SETTINGS, 3, "minimal-ckpt-7")
    assert pod["metadata"]["name"] == "minimal-3"
    assert pod["metadata"]["annotations"] == {protocol.ANNOTATION_RESTORE_FROM: "minimal-ckpt-7",
                                              protocol.ANNOTATION_WORKSPACE_PATH: "/workspace",
                                              **SAFE}
    assert pod["spec"]["containers"][0]["command"] == [
        "/.hermit/hermit-init", "--restore", "--restore-timeout", "300", "--",
        "python", "-m", "http.server", "8000"]


def test_full_sample_keeps_user_metadata_workspace_and_placement() -> None:
    sb = sample("agentsandbox-full.yaml")
    before = copy.deepcopy(sb)
    pod = build_sandbox_pod(sb, SETTINGS, 1, None)
    assert sb == before  # the input is not changed
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["labels"]["team"] == "research"
    assert meta["annotations"] == {"example.com/owner": "alice",
                                   protocol.ANNOTATION_WORKSPACE_PATH: "/workspace", **SAFE}
    assert spec["terminationGracePeriodSeconds"] == 30  # the user's choice wins
    assert spec["containers"][0]["env"] == [{"name": "MODEL", "value": "small"}]
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["hermit-workspace"]["emptyDir"] == {"sizeLimit": "20Gi"}
    assert spec["nodeSelector"] == {"node.kubernetes.io/instance-type": "m7i.xlarge"}
    assert required_terms(spec) == spot_terms()  # placement.nodeSelector keeps the spot terms
    assert spec["tolerations"][0] == {"key": "spot", "operator": "Exists",
                                      "effect": "NoSchedule"}
    assert len(spec["tolerations"]) == 1 + len(podspec.SPOT_TOLERATIONS)


def test_user_node_selector_replaces_the_spot_selector() -> None:
    sb = sample("agentsandbox-minimal.yaml")
    sb["spec"]["podTemplate"]["spec"]["nodeSelector"] = {"pool": "gpu"}
    sb["spec"]["placement"] = {"spot": True, "nodeSelector": {"zone": "a"}}
    spec = build_sandbox_pod(sb, PLACEMENT_EXEMPT, 1, None)["spec"]
    assert spec["nodeSelector"] == {"pool": "gpu", "zone": "a"}
    assert "affinity" not in spec  # the template's nodeSelector chose the nodes
    assert len(spec["tolerations"]) == len(podspec.SPOT_TOLERATIONS)


def test_on_demand_placement_adds_no_spot_terms_and_dedups_tolerations() -> None:
    sb = sample("agentsandbox-minimal.yaml")
    tol = {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}
    sb["spec"]["podTemplate"]["spec"]["tolerations"] = [tol]
    sb["spec"]["placement"] = {"spot": False, "tolerations": [tol]}
    spec = build_sandbox_pod(sb, SETTINGS, 1, None)["spec"]
    assert "nodeSelector" not in spec and "affinity" not in spec
    assert spec["tolerations"] == [tol]


# A node label requirement, as the scheduler reads it (operators In and NotIn only; NotIn
# also holds for a node without the label).
def term_matches(term: dict[str, Any], labels: dict[str, str]) -> bool:
    """A nodeSelectorTerm against a node's labels: all its requirements hold; an empty term
    matches no node."""
    assert not term.get("matchFields")
    expressions = term.get("matchExpressions") or []
    for expr in expressions:
        assert expr["operator"] in ("In", "NotIn"), expr
    return bool(expressions) and all(
        (labels.get(e["key"]) in e["values"]) == (e["operator"] == "In") for e in expressions)


def schedules_on(spec: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether the pod's nodeSelector and required node affinity admit a node with these labels
    (nodeSelector ANDed with the affinity, whose terms are ORed)."""
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    terms = required_terms(spec)
    return terms is None or any(term_matches(t, labels) for t in terms)


def required_terms(spec: dict[str, Any]) -> list[dict[str, Any]] | None:
    required = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution"))
    return None if required is None else list(required["nodeSelectorTerms"])


def spot_terms() -> list[dict[str, Any]]:
    return [{"matchExpressions": [{"key": k, "operator": "In", "values": [v]}]}
            for k, v in podspec.SPOT_NODE_LABELS]


SPOT_NODES = {
    "karpenter": {"karpenter.sh/capacity-type": "spot"},
    "eks": {"eks.amazonaws.com/capacityType": "SPOT"},
    "gke-spot": {"cloud.google.com/gke-spot": "true"},
    "gke-provisioning": {"cloud.google.com/gke-provisioning": "spot"},
    "aks": {"kubernetes.azure.com/scalesetpriority": "spot"},
    # several conventions on one node (docs/cluster.md's kind example)
    "several": {"karpenter.sh/capacity-type": "spot",
                "eks.amazonaws.com/capacityType": "SPOT",
                "cloud.google.com/gke-spot": "true"},
}
ON_DEMAND_NODES = {
    "plain": {"kubernetes.io/hostname": "n1"},
    "karpenter": {"karpenter.sh/capacity-type": "on-demand"},
    "eks": {"eks.amazonaws.com/capacityType": "ON_DEMAND"},
    "gke": {"cloud.google.com/gke-provisioning": "standard"},
    "aks": {"kubernetes.azure.com/scalesetpriority": "regular"},
    "several": {"karpenter.sh/capacity-type": "on-demand",
                "eks.amazonaws.com/capacityType": "ON_DEMAND"},
}


@pytest.mark.parametrize("convention", sorted(SPOT_NODES))
def test_a_spot_node_of_each_convention_schedules_the_default_sandbox(convention: str) -> None:
    spec = build_sandbox_pod(sample("agentsandbox-minimal.yaml"), SETTINGS, 1, None)["spec"]
    labels = {"kubernetes.io/hostname": "n1", **SPOT_NODES[convention]}
    assert schedules_on(spec, labels)


@pytest.mark.parametrize("kind", sorted(ON_DEMAND_NODES))
def test_an_on_demand_node_does_not_schedule_the_default_sandbox(kind: str) -> None:
    spec = build_sandbox_pod(sample("agentsandbox-minimal.yaml"), SETTINGS, 1, None)["spec"]
    assert not schedules_on(spec, ON_DEMAND_NODES[kind])


def test_each_spot_label_is_its_own_term() -> None:
    spec = build_sandbox_pod(sample("agentsandbox-minimal.yaml"), SETTINGS, 1, None)["spec"]
    terms = required_terms(spec)
    assert terms == spot_terms()
    assert {k for k, _ in podspec.SPOT_NODE_LABELS} == {
        k for labels in SPOT_NODES.values() for k in labels}


def test_placement_node_selector_is_anded_with_the_spot_terms() -> None:
    sb = sample("agentsandbox-full.yaml")
    spec = build_sandbox_pod(sb, SETTINGS, 1, None)["spec"]
    m7i = {"node.kubernetes.io/instance-type": "m7i.xlarge"}
    assert schedules_on(spec, {**m7i, "eks.amazonaws.com/capacityType": "SPOT"})
    assert not schedules_on(spec, {**m7i, "eks.amazonaws.com/capacityType": "ON_DEMAND"})
    assert not schedules_on(spec, {"node.kubernetes.io/instance-type": "c7i.large",
                                   "eks.amazonaws.com/capacityType": "SPOT"})


def test_template_node_selector_means_the_user_chose_the_nodes() -> None:
    sb = sample("agentsandbox-minimal.yaml")
    sb["spec"]["podTemplate"]["spec"]["nodeSelector"] = {"pool": "gpu"}
    with pytest.raises(InvalidSpec, match=r"nodeSelector: a template nodeSelector switches "
                       r"the spot requirement off"):
        build_sandbox_pod(sb, SETTINGS, 1, None)
    spec = build_sandbox_pod(sb, PLACEMENT_EXEMPT, 1, None)["spec"]
    assert spec["nodeSelector"] == {"pool": "gpu"}
    assert required_terms(spec) is None
    assert schedules_on(spec, {"pool": "gpu"})  # on-demand or spot, as the user chose


def test_spot_false_requires_nothing_of_the_node() -> None:
    sb = sample("agentsandbox-full.yaml")
    sb["spec"]["placement"]["spot"] = False
    spec = build_sandbox_pod(sb, SETTINGS, 1, None)["spec"]
    assert required_terms(spec) is None
    assert spec["nodeSelector"] == {"node.kubernetes.io/instance-type": "m7i.xlarge"}
    assert schedules_on(spec, {"node.kubernetes.io/instance-type": "m7i.xlarge",
                               **ON_DEMAND_NODES["eks"]})
    assert spec["tolerations"] == [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]


def test_user_required_affinity_is_anded_with_the_spot_terms() -> None:
    sb = sample("agentsandbox-minimal.yaml")
    zone_a = {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a"]}
    gpu = {"key": "pool", "operator": "In", "values": ["gpu"]}
    preferred = [{"weight": 1, "preference": {"matchExpressions": [gpu]}}]
    pod_anti = {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"a": "b"}}}]}
    sb["spec"]["podTemplate"]["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [zone_a]},
                                      {"matchExpressions": [gpu]}]},
            "preferredDuringSchedulingIgnoredDuringExecution": preferred},
        "podAntiAffinity": pod_anti}
    before = copy.deepcopy(sb)
    spec = build_sandbox_pod(sb, SETTINGS, 1, None)["spec"]
    assert sb == before
    affinity = spec["affinity"]
    assert affinity["podAntiAffinity"] == pod_anti
    assert affinity["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == preferred
    terms = required_terms(spec)
    assert terms == [{"matchExpressions": [user, *spot["matchExpressions"]]}
                     for user in (zone_a, gpu) for spot in spot_terms()]
    for convention, labels in SPOT_NODES.items():
        assert schedules_on(spec, {"topology.kubernetes.io/zone": "a", **labels}), convention
        assert schedules_on(spec, {"pool": "gpu", **labels}), convention
        assert not schedules_on(spec, {"topology.kubernetes.io/zone": "b", **labels}), convention
    for kind, labels in ON_DEMAND_NODES.items():
        assert not schedules_on(spec, {"topology.kubernetes.io/zone": "a", "pool": "gpu",
                                       **labels}), kind


def test_an_empty_user_term_still_matches_no_node() -> None:
    sb = sample("agentsandbox-minimal.yaml")
    zone_a = {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a"]}
    sb["spec"]["podTemplate"]["spec"]["affinity"] = {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{}, {"matchExpressions": [zone_a]}]}}}
    terms = required_terms(build_sandbox_pod(sb, SETTINGS, 1, None)["spec"])
    assert terms is not None
    assert terms[0] == {} and len(terms) == 1 + len(podspec.SPOT_NODE_LABELS)


def test_user_required_affinity_with_spot_false_is_kept_as_is() -> None:
    sb = sample("agentsandbox-minimal.yaml")
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "eks.amazonaws.com/capacityType", "operator": "In", "values": ["SPOT"]}]}]}}}
    sb["spec"]["podTemplate"]["spec"]["affinity"] = affinity
    sb["spec"]["placement"] = {"spot": False}
    assert build_sandbox_pod(sb, SETTINGS, 1, None)["spec"]["affinity"] == affinity


def test_too_many_user_terms_to_combine_is_an_invalid_spec() -> None:
    sb = sample("agentsandbox-minimal.yaml")
    n = podspec.MAX_NODE_SELECTOR_TERMS // len(podspec.SPOT_NODE_LABELS) + 1
    sb["spec"]["podTemplate"]["spec"]["affinity"] = {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": [str(i)]}]}
            for i in range(n)]}}}
    with pytest.raises(InvalidSpec, match=r"set spec\.placement\.spot: false and require spot "
                       "nodes"):
        podspec.validate(sb)
    sb["spec"]["placement"] = {"spot": False}
    podspec.validate(sb)
    build_sandbox_pod(sb, SETTINGS, 1, None)


def test_workspace_mount_path_and_integer_size() -> None:
    sb = sample("agentsandbox-minimal.yaml")
    sb["spec"]["workspace"] = {"size": 1073741824, "mountPath": "/home/agent"}
    spec = build_sandbox_pod(sb, SETTINGS, 1, None)["spec"]
    assert {"name": "hermit-workspace", "mountPath": "/home/agent"} in spec["containers"][0][
        "volumeMounts"]
    assert {"name": "hermit-workspace", "emptyDir": {"sizeLimit": "1073741824"}} in spec[
        "volumes"]


def test_missing_command_is_a_permanent_error() -> None:
    sb = sample("agentsandbox-minimal.yaml")
    del sb["spec"]["podTemplate"]["spec"]["containers"][0]["command"]
    with pytest.raises(InvalidSpec, match=r"^spec\.podTemplate\.spec\.containers\[0\]\.command "
                       "is required: Hermit runs it under its init$"):
        build_sandbox_pod(sb, SETTINGS, 1, None)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.update(volumes=[{"name": "hermit-init", "emptyDir": {}}]), "reserved"),
        (lambda s: s.update(initContainers=[{"name": "hermit-init", "image": "x"}]), "reserved"),
        (lambda s: s["containers"][0].update(
            volumeMounts=[{"name": "v", "mountPath": "/workspace"}]), "/workspace is reserved"),
        (lambda s: s.update(containers=[]), "at least one container"),
    ],
)
def test_reserved_names_and_paths_are_refused(edit: Any, message: str) -> None:
    sb = sample("agentsandbox-minimal.yaml")
    edit(sb["spec"]["podTemplate"]["spec"])
    with pytest.raises(InvalidSpec, match=message):
        build_sandbox_pod(sb, SETTINGS, 1, None)


def test_workspace_path_annotation_follows_the_mount_path_and_protocol_keys_are_ours() -> None:
    sb = sample("agentsandbox-minimal.yaml")
    sb["spec"]["workspace"] = {"mountPath": "/home/agent/work"}
    sb["spec"]["podTemplate"]["metadata"] = {"annotations": {
        protocol.ANNOTATION_RESTORE_FROM: "forged", protocol.ANNOTATION_RESTORE_PHASE: "Restored",
        protocol.ANNOTATION_RESTORE_MESSAGE: "x", "keep": "me"}}
    fresh = build_sandbox_pod(sb, SETTINGS, 1, None)["metadata"]["annotations"]
    assert fresh == {protocol.ANNOTATION_WORKSPACE_PATH: "/home/agent/work", "keep": "me",
                     **SAFE}
    restore = build_sandbox_pod(sb, SETTINGS, 2, "c-1")["metadata"]["annotations"]
    assert restore[protocol.ANNOTATION_RESTORE_FROM] == "c-1"
    assert protocol.ANNOTATION_RESTORE_PHASE not in restore


@pytest.mark.parametrize(
    ("toleration", "tolerates"),
    [
        ({"operator": "Exists"}, True),
        ({"operator": "Exists", "effect": "NoSchedule"}, True),
        ({"operator": "Exists", "effect": "NoExecute"}, False),
        ({"key": protocol.TAINT_INTERRUPTION, "operator": "Exists"}, True),
        ({"key": protocol.TAINT_INTERRUPTION, "value": "aws", "effect": "NoSchedule"}, True),
        ({"key": protocol.TAINT_INTERRUPTION, "operator": "Exists", "effect": "PreferNoSchedule"},
         False),
        ({"key": "spot", "operator": "Exists"}, False),
        ({"key": "", "operator": "Equal", "value": "x"}, False),
    ],
)
def test_tolerates_interruption(toleration: dict[str, Any], tolerates: bool) -> None:
    assert podspec.tolerates_interruption(toleration) is tolerates


def test_hermit_never_tolerates_the_interruption_taint() -> None:
    for name in ("agentsandbox-minimal.yaml", "agentsandbox-full.yaml"):
        for spot in (True, False):
            sb = sample(name)
            sb["spec"]["placement"] = {**(sb["spec"].get("placement") or {}), "spot": spot}
            tols = build_sandbox_pod(sb, SETTINGS, 1, None)["spec"].get("tolerations") or []
            assert not any(podspec.tolerates_interruption(t) for t in tols), (name, spot)


@pytest.mark.parametrize("where", ["podTemplate", "placement"])
def test_tolerating_the_interruption_taint_is_an_invalid_spec(where: str) -> None:
    sb = sample("agentsandbox-minimal.yaml")
    tol = {"operator": "Exists"}
    if where == "podTemplate":
        sb["spec"]["podTemplate"]["spec"]["tolerations"] = [tol]
    else:
        sb["spec"]["placement"] = {"tolerations": [tol]}
    with pytest.raises(InvalidSpec, match=r"tolerates the hermit\.dev/interruption taint"):
        build_sandbox_pod(sb, SETTINGS, 1, None)


def test_protocol_annotations_of_the_node_agent_are_never_copied_from_the_template() -> None:
    sb = sample("agentsandbox-minimal.yaml")
    sb["spec"]["podTemplate"]["metadata"] = {"annotations": {
        protocol.ANNOTATION_RESTORE_RETRYABLE: "false", protocol.ANNOTATION_ON_PREEMPTION: "false"}}
    annotations = build_sandbox_pod(sb, SETTINGS, 1, None)["metadata"]["annotations"]
    assert annotations == {protocol.ANNOTATION_WORKSPACE_PATH: "/workspace", **SAFE}


def test_on_preemption_false_marks_the_pod_and_drops_the_budget() -> None:
    sb = sample("agentsandbox-minimal.yaml")
    sb["spec"]["checkpoint"] = {"onPreemption": False}
    annotations = build_sandbox_pod(sb, SETTINGS, 1, None)["metadata"]["annotations"]
    assert annotations[protocol.ANNOTATION_ON_PREEMPTION] == "false"
    assert podspec.disruption_budget(sb) is None and not podspec.on_preemption(sb)


def test_disruption_budget_blocks_evictions_of_the_sandbox_pods() -> None:
    sb = sample("agentsandbox-full.yaml")
    assert podspec.on_preemption(sb)
    pdb = podspec.disruption_budget(sb)
    assert pdb is not None
    name = sb["metadata"]["name"]
    assert (pdb["apiVersion"], pdb["kind"]) == ("policy/v1", "PodDisruptionBudget")
    assert pdb["metadata"]["name"] == podspec.pdb_name(name) == name
    assert pdb["metadata"]["namespace"] == "team-a"
    assert pdb["metadata"]["ownerReferences"] == [{
        "apiVersion": "hermit.dev/v1alpha1", "kind": "AgentSandbox", "name": name,
        "uid": "uid-1234", "controller": True, "blockOwnerDeletion": True}]
    assert pdb["spec"] == {"maxUnavailable": 0,
                           "selector": {"matchLabels": {protocol.LABEL_SANDBOX: name}}}
    pod_labels = build_sandbox_pod(sb, SETTINGS, 3, None)["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


# -- the on-demand fallback pod (spec.placement.fallbackToOnDemandAfterSeconds) ----------

@pytest.mark.parametrize("kind", sorted(ON_DEMAND_NODES))
def test_the_fallback_pod_schedules_on_each_kind_of_on_demand_node(kind: str) -> None:
    pod = build_sandbox_pod(sample("agentsandbox-minimal.yaml"), SETTINGS, 2, "minimal-1-preempt",
                            on_demand=True)
    assert pod["metadata"]["labels"][protocol.LABEL_CAPACITY] == "on-demand"
    assert schedules_on(pod["spec"], ON_DEMAND_NODES[kind])


@pytest.mark.parametrize("convention", sorted(SPOT_NODES))
def test_the_fallback_pod_never_schedules_on_a_spot_node(convention: str) -> None:
    spec = build_sandbox_pod(sample("agentsandbox-minimal.yaml"), SETTINGS, 2, None,
                             on_demand=True)["spec"]
    assert not schedules_on(spec, {"kubernetes.io/hostname": "n1", **SPOT_NODES[convention]})
    # One term: a node without any of the spot labels.
    assert required_terms(spec) == [{"matchExpressions": [
        {"key": k, "operator": "NotIn", "values": [v]} for k, v in podspec.SPOT_NODE_LABELS]}]


def test_the_fallback_pod_restores_the_same_checkpoint_and_keeps_the_rest() -> None:
    sb = sample("agentsandbox-full.yaml")
    spot = build_sandbox_pod(sb, SETTINGS, 2, "full-1-preempt")
    on_demand = build_sandbox_pod(sb, SETTINGS, 3, "full-1-preempt", on_demand=True)
    assert on_demand["metadata"]["annotations"][protocol.ANNOTATION_RESTORE_FROM] == \
        "full-1-preempt"
    assert on_demand["spec"]["containers"] == spot["spec"]["containers"]
    assert on_demand["spec"]["nodeSelector"] == spot["spec"]["nodeSelector"]
    assert on_demand["spec"]["tolerations"] == spot["spec"]["tolerations"]
    m7i = {"node.kubernetes.io/instance-type": "m7i.xlarge"}
    assert schedules_on(on_demand["spec"], {**m7i, **ON_DEMAND_NODES["eks"]})
    assert not schedules_on(on_demand["spec"], {**m7i, **SPOT_NODES["eks"]})
    assert not schedules_on(on_demand["spec"], ON_DEMAND_NODES["eks"])  # the selector holds


def test_the_fallback_pod_ands_the_user_terms_with_not_spot() -> None:
    sb = sample("agentsandbox-minimal.yaml")
    zone_a = {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a"]}
    sb["spec"]["podTemplate"]["spec"]["affinity"] = {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{}, {"matchExpressions": [zone_a]}]}}}
    spec = build_sandbox_pod(sb, SETTINGS, 2, None, on_demand=True)["spec"]
    terms = required_terms(spec)
    assert terms is not None and terms[0] == {} and len(terms) == 2
    assert schedules_on(spec, {"topology.kubernetes.io/zone": "a", **ON_DEMAND_NODES["aks"]})
    assert not schedules_on(spec, {"topology.kubernetes.io/zone": "a", **SPOT_NODES["aks"]})
    assert not schedules_on(spec, {"topology.kubernetes.io/zone": "b"})


@pytest.mark.parametrize("placement", [{"spot": False}, {"spot": False,
                                                         "fallbackToOnDemandAfterSeconds": 5}])
def test_a_sandbox_that_requires_no_spot_node_has_no_capacity_and_no_fallback(
        placement: dict[str, Any]) -> None:
    sb = sample("agentsandbox-minimal.yaml")
    sb["spec"]["placement"] = placement
    for on_demand in (False, True):
        pod = build_sandbox_pod(sb, SETTINGS, 1, None, on_demand=on_demand)
        assert protocol.LABEL_CAPACITY not in pod["metadata"]["labels"]
        assert "affinity" not in pod["spec"]
        assert podspec.capacity_of(pod) is None
    assert podspec.fallback_after_seconds(sb) is None


def test_the_capacity_label_is_the_operators() -> None:
    sb = sample("agentsandbox-minimal.yaml")
    sb["spec"]["podTemplate"]["metadata"] = {"labels": {protocol.LABEL_CAPACITY: "on-demand"}}
    pod = build_sandbox_pod(sb, SETTINGS, 1, None)
    assert podspec.capacity_of(pod) == "spot"
    assert podspec.capacity_of({"metadata": {"labels": {protocol.LABEL_CAPACITY: "cheap"}}}) \
        is None
    assert podspec.capacity_of(None) is None


@pytest.mark.parametrize(("value", "after"), [(None, None), (0, 0), (90, 90), ("30", 30),
                                              (True, None), ("soon", None)])
def test_fallback_after_seconds(value: Any, after: int | None) -> None:
    sb = sample("agentsandbox-minimal.yaml")
    if value is not None:
        sb["spec"]["placement"] = {"fallbackToOnDemandAfterSeconds": value}
    assert podspec.fallback_after_seconds(sb) == after


# -- only nodes with a ready node-agent (protocol.LABEL_NODE_AGENT) --------------------------

READY_EXPR = {"key": protocol.LABEL_NODE_AGENT, "operator": "In",
              "values": [protocol.NODE_AGENT_READY]}
AGENT_READY = {protocol.LABEL_NODE_AGENT: protocol.NODE_AGENT_READY}


def with_ready(terms: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The terms the pod gets with the requirement on: each non-empty one with READY_EXPR
    appended, or READY_EXPR alone when there is none."""
    if not terms:
        return [{"matchExpressions": [READY_EXPR]}]
    return [t if not t.get("matchExpressions") else
            {**t, "matchExpressions": [*t["matchExpressions"], READY_EXPR]} for t in terms]


def both(sb: dict[str, Any], **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pod spec without and with the requirement (the same sandbox)."""
    off = build_sandbox_pod(copy.deepcopy(sb), SETTINGS, 1, None, **kwargs)["spec"]
    on = build_sandbox_pod(copy.deepcopy(sb), READY, 1, None, **kwargs)["spec"]
    return off, on


def test_the_ready_node_agent_label_is_required_by_default() -> None:
    assert OperatorSettings().require_ready_node_agent
    assert OperatorSettings.from_env({}).require_ready_node_agent
    assert not OperatorSettings.from_env(
        {"HERMIT_REQUIRE_READY_NODE_AGENT": "false"}).require_ready_node_agent
    assert podspec.READY_NODE_AGENT == READY_EXPR


def test_a_sandbox_without_node_affinity_gets_one_term_for_the_ready_node_agent() -> None:
    sb = sample("agentsandbox-minimal.yaml")
    sb["spec"]["placement"] = {"spot": False}
    off, on = both(sb)
    assert required_terms(off) is None
    assert required_terms(on) == [{"matchExpressions": [READY_EXPR]}]
    assert schedules_on(on, {"kubernetes.io/hostname": "n1", **AGENT_READY})
    assert not schedules_on(on, {"kubernetes.io/hostname": "n1"})
    assert not schedules_on(on, {protocol.LABEL_NODE_AGENT: "x"})


def test_every_spot_term_requires_the_ready_node_agent() -> None:
    off, on = both(sample("agentsandbox-minimal.yaml"))
    assert required_terms(off) == spot_terms()
    assert required_terms(on) == with_ready(spot_terms())
    for convention, labels in SPOT_NODES.items():
        assert schedules_on(on, {**labels, **AGENT_READY}), convention
        assert not schedules_on(on, labels), convention
    for kind, labels in ON_DEMAND_NODES.items():
        assert not schedules_on(on, {**labels, **AGENT_READY}), kind


def test_every_on_demand_fallback_term_requires_the_ready_node_agent() -> None:
    sb = sample("agentsandbox-minimal.yaml")
    sb["spec"]["placement"] = {"fallbackToOnDemandAfterSeconds": 60}
    off, on = both(sb, on_demand=True)
    terms = required_terms(off)
    assert terms is not None and len(terms) == 1
    assert required_terms(on) == with_ready(terms)
    for kind, labels in ON_DEMAND_NODES.items():
        assert schedules_on(on, {**labels, **AGENT_READY}), kind
        assert not schedules_on(on, labels), kind


def test_each_of_the_users_required_terms_requires_the_ready_node_agent() -> None:
    sb = sample("agentsandbox-minimal.yaml")
    zone_a = {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a"]}
    gpu = {"key": "pool", "operator": "In", "values": ["gpu"]}
    preferred = [{"weight": 1, "preference": {"matchExpressions": [gpu]}}]
    sb["spec"]["podTemplate"]["spec"]["affinity"] = {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{}, {"matchExpressions": [zone_a]},
                                  {"matchExpressions": [gpu]}]},
        "preferredDuringSchedulingIgnoredDuringExecution": preferred}}
    before = copy.deepcopy(sb)
    for spot in (True, False):
        sb["spec"]["placement"] = {"spot": spot}
        off, on = both(sb)
        assert sb["spec"]["podTemplate"] == before["spec"]["podTemplate"]
        terms = required_terms(off)
        assert terms is not None and len(terms) == (
            1 + 2 * len(podspec.SPOT_NODE_LABELS) if spot else 3)
        assert required_terms(on) == with_ready(terms)
        assert required_terms(on)[0] == {}  # still matches no node
        assert on["affinity"]["nodeAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"] == preferred
        spot_node = SPOT_NODES["eks"] if spot else {}
        for user in ({"topology.kubernetes.io/zone": "a"}, {"pool": "gpu"}):
            assert schedules_on(on, {**user, **spot_node, **AGENT_READY}), (spot, user)
            assert not schedules_on(on, {**user, **spot_node}), (spot, user)


def test_a_template_node_selector_still_gets_the_ready_node_agent_term() -> None:
    sb = sample("agentsandbox-minimal.yaml")
    sb["spec"]["podTemplate"]["spec"]["nodeSelector"] = {"pool": "gpu"}
    ready = dataclasses.replace(PLACEMENT_EXEMPT, require_ready_node_agent=True)
    on = build_sandbox_pod(sb, ready, 1, None)["spec"]
    assert on["nodeSelector"] == {"pool": "gpu"}
    assert required_terms(on) == [{"matchExpressions": [READY_EXPR]}]
    assert schedules_on(on, {"pool": "gpu", **AGENT_READY})
    assert not schedules_on(on, {"pool": "gpu"})


def test_with_the_setting_off_no_term_names_the_node_agent() -> None:
    for name in ("agentsandbox-minimal.yaml", "agentsandbox-full.yaml"):
        for spot in (True, False):
            sb = sample(name)
            sb["spec"]["placement"] = {**(sb["spec"].get("placement") or {}), "spot": spot}
            off = build_sandbox_pod(sb, SETTINGS, 1, None)["spec"]
            assert protocol.LABEL_NODE_AGENT not in repr(off.get("affinity")), (name, spot)
