"""The CRDs in crds/ are the API of record: check their shape, samples and rules.

- structural-schema rules the API server enforces (types everywhere, no
  ``additionalProperties`` beside ``properties``, unknown fields kept only where
  intended),
- printer columns point at fields that exist, enums match hermit_common.api,
- samples validate against the OpenAPI schema (converted to JSON Schema), and
  invalid documents are rejected,
- CEL rules (x-kubernetes-validations) compile and hold for the samples, and
  reject what they are meant to reject (needs ``cel-python``, the dev extra: a missing
  one fails the test with how to install it).
"""

from __future__ import annotations

import copy
import datetime
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import yaml

from hermit_common import api, protocol
from tests.support.crds import (
    _FORMATS,
    CRD_DIR,
    CRDS,
    Doc,
    Schema,
    crd_for,
    schema_errors,
    schema_of,
    to_json_schema,
    version_of,
    walk,
)

SAMPLE_DIR = CRD_DIR / "samples"


# Where unknown fields are kept on purpose: the embedded pod template and tolerations.
INTENDED_PRESERVE_UNKNOWN = {
    "agentsandboxes": {
        ".spec.podTemplate.metadata",
        ".spec.podTemplate.spec",
        ".spec.podTemplate.spec.containers[]",
        ".spec.placement.tolerations[]",
    },
    "checkpoints": set(),
}


# --- loading -----------------------------------------------------------------


def load_samples() -> dict[str, Doc]:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(SAMPLE_DIR.glob("*.yaml"))}


SAMPLES = load_samples()


# --- OpenAPI (Kubernetes subset) -> JSON Schema --------------------------------


@_FORMATS.checks("date-time", raises=ValueError)
def _is_date_time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    if not re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", value):
        raise ValueError(f"{value!r} is not an RFC 3339 date-time")
    datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    return True


def with_defaults(schema: Schema, value: Any) -> Any:
    """A copy of value with the schema's defaults filled in, as the API server does."""
    value = copy.deepcopy(value)
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = with_defaults(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in set(value) - set(schema.get("properties", {})):
                value[name] = with_defaults(extra, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [with_defaults(schema["items"], item) for item in value]
    return value


def defaulted(doc: Doc) -> Doc:
    result: Doc = with_defaults(schema_of(crd_for(doc)), doc)
    return result


# --- the CRDs themselves --------------------------------------------------------


def test_names_match_hermit_common_api() -> None:
    expected = {
        api.SANDBOX_PLURAL: (api.SANDBOX_KIND, "asb"),
        api.CHECKPOINT_PLURAL: (api.CHECKPOINT_KIND, "ckpt"),
    }
    assert set(CRDS) == set(expected)
    for plural, (kind, short) in expected.items():
        crd = CRDS[plural]
        assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
        assert crd["metadata"]["name"] == f"{plural}.{api.GROUP}"
        assert crd["spec"]["group"] == api.GROUP
        assert crd["spec"]["scope"] == "Namespaced"
        names = crd["spec"]["names"]
        assert names["kind"] == kind
        assert names["shortNames"] == [short]
        assert names["categories"] == ["hermit"]
        assert [v["name"] for v in crd["spec"]["versions"]] == [api.VERSION]
        version = version_of(crd)
        assert version["served"] is True
        assert version["storage"] is True
        assert version["subresources"] == {"status": {}}


def test_enums_match_hermit_common_api() -> None:
    sandbox = dict(walk(schema_of(CRDS[api.SANDBOX_PLURAL])))
    checkpoint = dict(walk(schema_of(CRDS[api.CHECKPOINT_PLURAL])))
    assert tuple(sandbox[".status.phase"]["enum"]) == api.SANDBOX_PHASES
    assert tuple(sandbox[".status.lastCheckpoint.reason"]["enum"]) == protocol.REASONS
    assert tuple(sandbox[".status.capacity"]["enum"]) == api.CAPACITIES
    assert tuple(checkpoint[".spec.reason"]["enum"]) == protocol.REASONS
    assert tuple(checkpoint[".status.phase"]["enum"]) == protocol.CHECKPOINT_PHASES
    assert sandbox[".status.conditions[].status"]["enum"] == ["True", "False", "Unknown"]


@pytest.mark.parametrize("plural", sorted(CRDS))
def test_schema_is_structural(plural: str) -> None:
    schema = schema_of(CRDS[plural])
    assert schema.get("type") == "object"
    assert schema["properties"]["metadata"] == {"type": "object"}, (
        "the root metadata may only say type: object"
    )
    problems: list[str] = []
    for path, node in walk(schema):
        where = path or "<root>"
        if "type" not in node and not node.get("x-kubernetes-int-or-string"):
            problems.append(f"{where}: no type")
        if "properties" in node and "additionalProperties" in node:
            problems.append(f"{where}: additionalProperties beside properties")
        if node.get("type") == "object" and isinstance(node.get("items"), dict):
            problems.append(f"{where}: items on an object")
        if node.get("type") == "array" and not isinstance(node.get("items"), dict):
            problems.append(f"{where}: array without an items schema")
        for key in ("anyOf", "allOf", "oneOf"):
            for branch in node.get(key, []):
                banned = {"description", "default", "additionalProperties", "nullable"}
                if not node.get("x-kubernetes-int-or-string"):
                    banned.add("type")
                if banned & set(branch):
                    problems.append(f"{where}: {key} branch sets {sorted(banned & set(branch))}")
        if node.get("x-kubernetes-int-or-string"):
            assert node.get("anyOf") == [{"type": "integer"}, {"type": "string"}], where
        if node.get("x-kubernetes-list-type") == "map":
            required = set(node["items"].get("required", []))
            keys = set(node.get("x-kubernetes-list-map-keys", []))
            if not keys or not keys <= required:
                problems.append(f"{where}: list-map keys {sorted(keys)} must be required")
    assert problems == []


@pytest.mark.parametrize("plural", sorted(CRDS))
def test_unknown_fields_are_kept_only_where_intended(plural: str) -> None:
    preserved = {
        path for path, node in walk(schema_of(CRDS[plural]))
        if node.get("x-kubernetes-preserve-unknown-fields")
    }
    assert preserved == INTENDED_PRESERVE_UNKNOWN[plural]


@pytest.mark.parametrize("plural", sorted(CRDS))
def test_defaults_are_valid(plural: str) -> None:
    for path, node in walk(schema_of(CRDS[plural])):
        if "default" in node:
            validator = jsonschema.Draft202012Validator(to_json_schema(node))
            errors = [e.message for e in validator.iter_errors(node["default"])]
            assert errors == [], f"default of {path}"


_COLUMN_TYPES = {"integer": {"integer"}, "number": {"integer", "number"},
                 "string": {"string"}, "boolean": {"boolean"}, "date": {"string"}}


@pytest.mark.parametrize("plural", sorted(CRDS))
def test_printer_columns_point_at_existing_fields(plural: str) -> None:
    nodes = dict(walk(schema_of(CRDS[plural])))
    columns = version_of(CRDS[plural])["additionalPrinterColumns"]
    for column in columns:
        path = column["jsonPath"]
        if path == ".metadata.creationTimestamp":
            assert column["type"] == "date"
            continue
        assert path in nodes, f"column {column['name']} points at missing field {path}"
        node = nodes[path]
        assert node["type"] in _COLUMN_TYPES[column["type"]], column["name"]
        if column["type"] == "date":
            assert node.get("format") == "date-time", column["name"]
    names = [c["name"] for c in columns if c.get("priority", 0) == 0]
    expected = {
        api.SANDBOX_PLURAL: ["Phase", "Node", "Last Checkpoint", "Checkpoint Size", "Restores",
                             "Age"],
        api.CHECKPOINT_PLURAL: ["Sandbox", "Reason", "Phase", "Progress", "Size", "Duration",
                                "Parent", "Age"],
    }
    assert names == expected[plural]


def _rules(crd: Doc) -> Iterator[tuple[str, Doc]]:
    for path, node in walk(schema_of(crd)):
        for rule in node.get("x-kubernetes-validations", []):
            yield path, rule


def test_every_rule_has_a_readable_message() -> None:
    for crd in CRDS.values():
        for path, rule in _rules(crd):
            message = rule.get("message", "")
            assert message, f"rule {rule['rule']!r} at {path} has no message"
            assert "\n" not in message and not message.endswith("."), message
            assert len(message) <= 120, message
            assert rule.get("reason", "FieldValueInvalid") in _RULE_REASONS, rule
            if "fieldPath" in rule:
                node = dict(walk(schema_of(crd)))[path]
                assert f"{path}{rule['fieldPath']}" in dict(walk(schema_of(crd))), rule
                assert node["type"] == "object", rule


_RULE_REASONS = {"FieldValueInvalid", "FieldValueForbidden", "FieldValueRequired",
                 "FieldValueDuplicate"}


# --- samples and invalid documents -----------------------------------------------


def test_samples_cover_both_kinds_and_every_sandbox_field() -> None:
    kinds = sorted(doc["kind"] for doc in SAMPLES.values())
    assert kinds == ["AgentSandbox", "AgentSandbox", "Checkpoint"]
    full = SAMPLES["agentsandbox-full.yaml"]
    spec_schema = schema_of(CRDS[api.SANDBOX_PLURAL])["properties"]["spec"]
    missing = [
        path for path, node in walk(spec_schema)
        if "[]" not in path and "{}" not in path and not path.startswith(".podTemplate.spec.")
        and not _has_path(full["spec"], path)
    ]
    assert missing == [], "agentsandbox-full.yaml must set every spec field"


def _has_path(value: Any, path: str) -> bool:
    for part in path.strip(".").split(".") if path else []:
        if not isinstance(value, dict) or part not in value:
            return False
        value = value[part]
    return True


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_sample_is_valid(name: str) -> None:
    assert schema_errors(SAMPLES[name]) == []
    assert schema_errors(defaulted(SAMPLES[name])) == []


def test_defaults_fill_the_minimal_sandbox() -> None:
    spec = defaulted(SAMPLES["agentsandbox-minimal.yaml"])["spec"]
    assert spec["workspace"] == {"size": "1Gi", "mountPath": "/workspace"}
    assert spec["checkpoint"] == {"onPreemption": True, "onTurn": False, "retain": 3}
    assert spec["placement"] == {"spot": True}
    assert spec["suspend"] is False


def _set(doc: Doc, path: str, value: Any) -> Doc:
    doc = copy.deepcopy(doc)
    *parents, last = path.split(".")
    target: Any = doc
    for part in parents:
        target = target[int(part)] if isinstance(target, list) else target.setdefault(part, {})
    if isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value
    return doc


def _drop(doc: Doc, path: str) -> Doc:
    doc = copy.deepcopy(doc)
    *parents, last = path.split(".")
    target: Any = doc
    for part in parents:
        target = target[int(part)] if isinstance(target, list) else target[part]
    del target[last]
    return doc


SANDBOX = SAMPLES["agentsandbox-full.yaml"]
CHECKPOINT = SAMPLES["checkpoint-manual.yaml"]
COMPLETED_STATUS = {
    "phase": "Completed",
    "nodeName": "node-a",
    "parent": "minimal-preempt",
    "frozenMs": 120, "dumpMs": 100, "uploadMs": 900,
    "imageBytes": 20_000_000, "uploadedBytes": 3_000_000, "storedBytes": 6_000_000,
    "storage": {"bucket": "bucket", "prefix": "hermit", "region": "us-east-1",
                "endpoint": "http://minio.minio:9000"},
    "manifestURI": "s3://bucket/hermit/default/minimal/checkpoints/minimal-manual-1/manifest.json",
    "manifestDigest": "sha256:" + "a" * 64,
    "criuVersion": "4.2.1",
    "kernel": "6.18.0",
    "cpuFeatures": ["avx2", "sse4_2"],
    "message": "checkpoint completed",
    "startedAt": "2025-01-01T00:00:00Z",
    "completedAt": "2025-01-01T00:00:01.5Z",
}
SANDBOX_STATUS = {
    "phase": "Running", "nodeName": "node-a", "podName": "full-1", "incarnation": 1,
    "capacity": "on-demand",
    "restores": 0, "observedGeneration": 1,
    "lastCheckpoint": {"name": "full-1", "time": "2025-01-01T00:00:00Z", "reason": "Interval"},
    "conditions": [{
        "type": "Ready", "status": "True", "reason": "PodRunning", "message": "",
        "lastTransitionTime": "2025-01-01T00:00:00Z", "observedGeneration": 1,
    }],
}


def test_statuses_are_valid() -> None:
    assert schema_errors(_set(SANDBOX, "status", SANDBOX_STATUS)) == []
    assert schema_errors(_set(CHECKPOINT, "status", COMPLETED_STATUS)) == []


INVALID: dict[str, tuple[Doc, str]] = {
    "negative intervalSeconds": (_set(SANDBOX, "spec.checkpoint.intervalSeconds", -5),
                                 "spec.checkpoint.intervalSeconds"),
    "intervalSeconds below 30": (_set(SANDBOX, "spec.checkpoint.intervalSeconds", 10),
                                 "spec.checkpoint.intervalSeconds"),
    "retain 0": (_set(SANDBOX, "spec.checkpoint.retain", 0), "spec.checkpoint.retain"),
    "negative fallbackToOnDemandAfterSeconds": (
        _set(SANDBOX, "spec.placement.fallbackToOnDemandAfterSeconds", -1),
        "spec.placement.fallbackToOnDemandAfterSeconds"),
    "fallbackToOnDemandAfterSeconds over a year": (
        _set(SANDBOX, "spec.placement.fallbackToOnDemandAfterSeconds", 31536001),
        "spec.placement.fallbackToOnDemandAfterSeconds"),
    "fallbackToOnDemandAfterSeconds not a number": (
        _set(SANDBOX, "spec.placement.fallbackToOnDemandAfterSeconds", "soon"),
        "spec.placement.fallbackToOnDemandAfterSeconds"),
    "bad capacity": (_set(SANDBOX, "status", {"capacity": "cheap"}), "status.capacity"),
    "no containers": (_set(SANDBOX, "spec.podTemplate.spec.containers", []),
                      "spec.podTemplate.spec.containers"),
    "container without image": (_drop(SANDBOX, "spec.podTemplate.spec.containers.0.image"),
                                "spec.podTemplate.spec.containers.0"),
    "no podTemplate": (_drop(SANDBOX, "spec.podTemplate"), "spec"),
    "bad workspace size": (_set(SANDBOX, "spec.workspace.size", "-1Gi"), "spec.workspace.size"),
    "relative mountPath": (_set(SANDBOX, "spec.workspace.mountPath", "work"),
                           "spec.workspace.mountPath"),
    "misspelt field": (_set(SANDBOX, "spec.checkpoint.intervalSecond", 60), "spec.checkpoint"),
    "storage without bucket": (_drop(SANDBOX, "spec.checkpoint.storage.bucket"),
                               "spec.checkpoint.storage"),
    "storage bucket too short": (_set(SANDBOX, "spec.checkpoint.storage.bucket", "ab"),
                                 "spec.checkpoint.storage.bucket"),
    "storage misspelt field": (_set(SANDBOX, "spec.checkpoint.storage.secret", "s"),
                               "spec.checkpoint.storage"),
    "secretRef without name": (_set(SANDBOX, "spec.checkpoint.storage.secretRef", {}),
                               "spec.checkpoint.storage.secretRef"),
    "checkpoint storage without bucket": (
        _set(CHECKPOINT, "status", {**COMPLETED_STATUS, "storage": {"prefix": "", "region": "r"}}),
        "status.storage"),
    "removed field storageClassName": (_set(SANDBOX, "spec.workspace.storageClassName", "gp3"),
                                       "spec.workspace"),
    "checkpoint spec.parent": (_set(CHECKPOINT, "spec.parent", "older"), "spec"),
    "bad sandbox phase": (_set(SANDBOX, "status", {"phase": "Sleeping"}), "status.phase"),
    "bad condition status": (
        _set(SANDBOX, "status", {"conditions": [
            {**SANDBOX_STATUS["conditions"][0], "status": "Yes"}]}),  # type: ignore[index]
        "status.conditions.0.status"),
    "bad reason": (_set(CHECKPOINT, "spec.reason", "Whim"), "spec.reason"),
    "no reason": (_drop(CHECKPOINT, "spec.reason"), "spec"),
    "no sandboxRef name": (_set(CHECKPOINT, "spec.sandboxRef", {}), "spec.sandboxRef"),
    "bad checkpoint phase": (_set(CHECKPOINT, "status", {"phase": "Done"}), "status.phase"),
    "bad digest": (_set(CHECKPOINT, "status", {**COMPLETED_STATUS, "manifestDigest": "md5:00"}),
                   "status.manifestDigest"),
    "negative bytes": (_set(CHECKPOINT, "status", {**COMPLETED_STATUS, "storedBytes": -1}),
                       "status.storedBytes"),
    "bad timestamp": (_set(CHECKPOINT, "status", {**COMPLETED_STATUS, "startedAt": "yesterday"}),
                      "status.startedAt"),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_document_is_rejected(case: str) -> None:
    doc, where = INVALID[case]
    errors = schema_errors(doc)
    assert errors, f"{case} was accepted"
    assert any(e.startswith(f"{where}:") for e in errors), errors


# --- CEL rules (x-kubernetes-validations) -------------------------------------------


def _celpy() -> Any:
    try:
        import celpy
    except ImportError:
        pytest.fail("cel-python is not installed: run hack/install-python (the dev extra)")
    return celpy


def _node_pairs(schema: Schema, new: Any, old: Any, path: str = "") -> Iterator[
        tuple[str, Schema, Any, Any]]:
    """(path, node, value, old value or None) for every node where a value exists."""
    yield path, schema, new, old
    if isinstance(new, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in new:
                old_sub = old.get(name) if isinstance(old, dict) else None
                yield from _node_pairs(sub, new[name], old_sub, f"{path}.{name}")
    if isinstance(new, list) and isinstance(schema.get("items"), dict):
        # Kubernetes pairs old and new list items only for map/set lists; atomic lists
        # get no oldSelf. None of our rules sit below a list, so pairing is not needed.
        for index, item in enumerate(new):
            yield from _node_pairs(schema["items"], item, None, f"{path}[{index}]")


def cel_violations(new: Doc, old: Doc | None = None) -> list[str]:
    """Messages of the CEL rules that new (an update of old, or a create) breaks."""
    celpy = _celpy()
    env = celpy.Environment()
    failures: list[str] = []
    for path, node, value, old_value in _node_pairs(schema_of(crd_for(new)), new, old):
        for rule in node.get("x-kubernetes-validations", []):
            transition = "oldSelf" in rule["rule"]
            if transition and old_value is None:
                continue  # transition rules only run on updates where the old value exists
            activation = {"self": celpy.json_to_cel(value)}
            if transition:
                activation["oldSelf"] = celpy.json_to_cel(old_value)
            result = env.program(env.compile(rule["rule"])).evaluate(activation)
            assert isinstance(result, celpy.celtypes.BoolType), f"{rule['rule']!r}: {result!r}"
            if not result:
                failures.append(f"{path or '<root>'}: {rule['message']}")
    return failures


def test_cel_rules_compile() -> None:
    celpy = _celpy()
    env = celpy.Environment()
    for crd in CRDS.values():
        for _path, rule in _rules(crd):
            env.compile(rule["rule"])


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_samples_pass_cel_rules_on_create_and_update(name: str) -> None:
    doc = defaulted(SAMPLES[name])
    assert cel_violations(doc) == []
    assert cel_violations(doc, old=doc) == []


def test_completed_checkpoint_status_passes_cel_rules() -> None:
    doc = defaulted(_set(CHECKPOINT, "status", COMPLETED_STATUS))
    assert cel_violations(doc, old=doc) == []


CEL_INVALID: dict[str, tuple[Doc, Doc | None, str]] = {
    "restoreFrom changed": (
        _set(SANDBOX, "spec.restoreFrom", "other"), SANDBOX, "spec.restoreFrom is immutable"),
    "restoreFrom removed": (
        _drop(SANDBOX, "spec.restoreFrom"), SANDBOX, "spec.restoreFrom can only be set"),
    "restoreFrom added": (
        SANDBOX, _drop(SANDBOX, "spec.restoreFrom"), "spec.restoreFrom can only be set"),
    "fallback without spot": (
        _set(SANDBOX, "spec.placement.spot", False), None,
        "placement.fallbackToOnDemandAfterSeconds only applies when placement.spot is true"),
    "long sandbox name": (
        _set(SANDBOX, "metadata.name", "x" * 64), None, "at most 63 characters"),
    "checkpoint reason changed": (
        _set(CHECKPOINT, "spec.reason", "Interval"), CHECKPOINT, "Checkpoint spec is immutable"),
    "checkpoint sandboxRef changed": (
        _set(CHECKPOINT, "spec.sandboxRef.name", "other"), CHECKPOINT,
        "Checkpoint spec is immutable"),
    "storage endpoint without secretRef": (
        _drop(SANDBOX, "spec.checkpoint.storage.secretRef"), None,
        "storage.endpoint needs storage.secretRef"),
    "storage bucket with capitals": (
        _set(SANDBOX, "spec.checkpoint.storage.bucket", "My-Bucket"), None,
        "bucket must be an S3 bucket name"),
    "storage bucket with two dots": (
        _set(SANDBOX, "spec.checkpoint.storage.bucket", "my..bucket"), None,
        "bucket must be an S3 bucket name"),
    "storage bucket ending in a hyphen": (
        _set(SANDBOX, "spec.checkpoint.storage.bucket", "bucket-"), None,
        "bucket must be an S3 bucket name"),
    "storage prefix with a leading slash": (
        _set(SANDBOX, "spec.checkpoint.storage.prefix", "/team"), None,
        "prefix must be segments"),
    "storage prefix with a trailing slash": (
        _set(SANDBOX, "spec.checkpoint.storage.prefix", "team/"), None,
        "prefix must be segments"),
    "storage prefix with a dot-dot segment": (
        _set(SANDBOX, "spec.checkpoint.storage.prefix", "team/../other"), None,
        "prefix must be segments"),
    "storage prefix with a double slash": (
        _set(SANDBOX, "spec.checkpoint.storage.prefix", "team//x"), None,
        "prefix must be segments"),
    "storage endpoint without scheme": (
        _set(SANDBOX, "spec.checkpoint.storage.endpoint", "minio:9000"), None,
        "endpoint must be an http or https URL"),
    "storage endpoint with a query": (
        _set(SANDBOX, "spec.checkpoint.storage.endpoint", "https://s3.example.com/?x=1"),
        None, "endpoint must be an http or https URL"),
    "storage endpoint ftp": (
        _set(SANDBOX, "spec.checkpoint.storage.endpoint", "ftp://files.example.com"), None,
        "endpoint must be an http or https URL"),
    "storage region with capitals": (
        _set(SANDBOX, "spec.checkpoint.storage.region", "EU-West-1"), None,
        "region must be lowercase"),
    "storage secret name with capitals": (
        _set(SANDBOX, "spec.checkpoint.storage.secretRef.name", "My_Secret"), None,
        "secretRef.name must be a Secret name"),
    "completed without digest": (
        _set(CHECKPOINT, "status", {k: v for k, v in COMPLETED_STATUS.items()
                                    if k != "manifestDigest"}),
        None, "a Completed checkpoint must record"),
}


@pytest.mark.parametrize("case", sorted(CEL_INVALID))
def test_cel_rule_rejects(case: str) -> None:
    new, old, message = CEL_INVALID[case]
    assert schema_errors(new) == [], "the document must pass the schema, only CEL rejects it"
    violations = cel_violations(defaulted(new), None if old is None else defaulted(old))
    assert any(message in v for v in violations), violations


STORAGE_ACCEPTED: dict[str, tuple[str, Any]] = {
    "bucket only": ("spec.checkpoint.storage", {"bucket": "team-a.checkpoints"}),
    "bucket and secret": ("spec.checkpoint.storage", {"bucket": "b-1", "secretRef": {
        "name": "s3.team-a"}}),
    "nested prefix": ("spec.checkpoint.storage.prefix", "org/team_a/v1.2"),
    "minio endpoint with a port and a path": ("spec.checkpoint.storage.endpoint",
                                              "http://minio.minio.svc:9000/s3"),
    "endpoint ip": ("spec.checkpoint.storage.endpoint", "http://10.213.0.1:39000"),
}


@pytest.mark.parametrize("case", sorted(STORAGE_ACCEPTED))
def test_storage_forms_that_are_accepted(case: str) -> None:
    path, value = STORAGE_ACCEPTED[case]
    doc = defaulted(_set(SANDBOX, path, value))
    assert schema_errors(doc) == []
    assert cel_violations(doc) == []
    assert cel_violations(doc, old=defaulted(SANDBOX)) == [], "storage may change later"
