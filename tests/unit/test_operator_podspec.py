from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from hermit_common import protocol
from hermit_common.settings import OperatorSettings
from hermit_operator import podspec
from hermit_operator.podspec import InvalidSpec, build_sandbox_pod

SAMPLES = Path(__file__).resolve().parents[2] / "crds" / "samples"
SETTINGS = OperatorSettings(init_image="registry.example/hermit:1.0",
                            init_path="/usr/local/bin/hermit-init")


def sample(name: str) -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load((SAMPLES / name).read_text())
    obj["metadata"].update(namespace="team-a", uid="uid-1234", generation=1)
    return obj


def test_minimal_sample_runs_under_hermit_init() -> None:
    pod = build_sandbox_pod(sample("agentsandbox-minimal.yaml"), SETTINGS, 1, None)
    meta, spec = pod["metadata"], pod["spec"]
    assert pod["apiVersion"] == "v1" and pod["kind"] == "Pod"
    assert meta["name"] == "minimal-1" and meta["namespace"] == "team-a"
    assert meta["labels"] == {protocol.LABEL_SANDBOX: "minimal", protocol.LABEL_INCARNATION: "1"}
    assert meta["annotations"] == {protocol.ANNOTATION_WORKSPACE_PATH: "/workspace"}
    assert meta["ownerReferences"] == [{
        "apiVersion": "hermit.dev/v1alpha1", "kind": "AgentSandbox", "name": "minimal",
        "uid": "uid-1234", "controller": True, "blockOwnerDeletion": True}]
    main = spec["containers"][0]
    assert main["command"] == ["/.hermit/hermit-init", "--", "python", "-m", "http.server",
                               "8000"]
    init = spec["initContainers"][0]
    assert init["image"] == "registry.example/hermit:1.0"
    assert init["command"] == ["cp", "/usr/local/bin/hermit-init", "/.hermit/hermit-init"]
    assert {"name": "hermit-init", "mountPath": "/.hermit"} in init["volumeMounts"]
    assert {"name": "hermit-init", "mountPath": "/.hermit", "readOnly": True} in main[
        "volumeMounts"]
    assert {"name": "hermit-workspace", "mountPath": "/workspace"} in main["volumeMounts"]
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["hermit-workspace"] == {"name": "hermit-workspace",
                                        "emptyDir": {"sizeLimit": "1Gi"}}
    assert "emptyDir" in vols["hermit-init"]
    assert spec["restartPolicy"] == "Never"
    assert spec["terminationGracePeriodSeconds"] == 10
    assert spec["nodeSelector"] == {"karpenter.sh/capacity-type": "spot"}
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
                                              protocol.ANNOTATION_WORKSPACE_PATH: "/workspace"}
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
                                   protocol.ANNOTATION_WORKSPACE_PATH: "/workspace"}
    assert spec["terminationGracePeriodSeconds"] == 30  # the user's choice wins
    assert spec["containers"][0]["env"] == [{"name": "MODEL", "value": "small"}]
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["hermit-workspace"]["emptyDir"] == {"sizeLimit": "20Gi"}
    assert spec["nodeSelector"] == {"node.kubernetes.io/instance-type": "m7i.xlarge",
                                    "karpenter.sh/capacity-type": "spot"}
    assert spec["tolerations"][0] == {"key": "spot", "operator": "Exists",
                                      "effect": "NoSchedule"}
    assert len(spec["tolerations"]) == 1 + len(podspec.SPOT_TOLERATIONS)


def test_user_node_selector_replaces_the_spot_selector() -> None:
    sb = sample("agentsandbox-minimal.yaml")
    sb["spec"]["podTemplate"]["spec"]["nodeSelector"] = {"pool": "gpu"}
    sb["spec"]["placement"] = {"spot": True, "nodeSelector": {"zone": "a"}}
    spec = build_sandbox_pod(sb, SETTINGS, 1, None)["spec"]
    assert spec["nodeSelector"] == {"pool": "gpu", "zone": "a"}


def test_on_demand_placement_adds_no_spot_terms_and_dedups_tolerations() -> None:
    sb = sample("agentsandbox-minimal.yaml")
    tol = {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}
    sb["spec"]["podTemplate"]["spec"]["tolerations"] = [tol]
    sb["spec"]["placement"] = {"spot": False, "tolerations": [tol]}
    spec = build_sandbox_pod(sb, SETTINGS, 1, None)["spec"]
    assert "nodeSelector" not in spec
    assert spec["tolerations"] == [tol]


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
    assert fresh == {protocol.ANNOTATION_WORKSPACE_PATH: "/home/agent/work", "keep": "me"}
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
    assert annotations == {protocol.ANNOTATION_WORKSPACE_PATH: "/workspace"}


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
