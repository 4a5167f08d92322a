"""The CRDs of record (crds/) for the tests: loading them, their schemas,
``schema_errors`` (does an object fit its CRD's schema, as the API server judges it), and
``adopt_crds`` (hack/adopt-crds through the Kubernetes client, for the e2e release)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hermit_common import api

ROOT = Path(__file__).resolve().parents[2]

CRD_DIR = ROOT / "crds"

Schema = dict[str, Any]

Doc = dict[str, Any]


def load_crds() -> dict[str, Doc]:
    """The CRDs in crds/, by plural."""
    crds: dict[str, Doc] = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        crds[doc["spec"]["names"]["plural"]] = doc
    return crds


def version_of(crd: Doc) -> Doc:
    versions: list[Doc] = crd["spec"]["versions"]
    (version,) = [v for v in versions if v["name"] == api.VERSION]
    return version


def schema_of(crd: Doc) -> Schema:
    schema: Schema = version_of(crd)["schema"]["openAPIV3Schema"]
    return schema


CRDS = load_crds()

CRD_NAMES = sorted(crd["metadata"]["name"] for crd in CRDS.values())

# What Helm checks before it takes an existing object into a release (hack/adopt-crds).
HELM_MANAGED_BY = ("app.kubernetes.io/managed-by", "Helm")
HELM_RELEASE_NAME = "meta.helm.sh/release-name"
HELM_RELEASE_NAMESPACE = "meta.helm.sh/release-namespace"


def adopt_crds(ext: client.ApiextensionsV1Api, release: str, namespace: str) -> list[str]:
    """hack/adopt-crds RELEASE NAMESPACE through ``ext`` (an ApiextensionsV1Api): Helm's
    ownership on each of Hermit's CRDs that exists, so that `helm install` or `upgrade`
    of the chart takes it over (and applies its schema) instead of refusing it. Returns
    the names it changed; idempotent."""
    changed = []
    for name in CRD_NAMES:
        try:
            meta = ext.read_custom_resource_definition(name).metadata
        except ApiException as exc:
            if exc.status == 404:
                continue  # the chart creates it
            raise
        key, value = HELM_MANAGED_BY
        owner = {HELM_RELEASE_NAME: release, HELM_RELEASE_NAMESPACE: namespace}
        labels, annotations = (meta.labels or {}, meta.annotations or {}) if meta else ({}, {})
        if labels.get(key) == value and all(annotations.get(k) == v for k, v in owner.items()):
            continue
        ext.patch_custom_resource_definition(
            name, {"metadata": {"labels": {key: value}, "annotations": owner}})
        changed.append(name)
    return changed

KIND_TO_PLURAL = {crd["spec"]["names"]["kind"]: plural for plural, crd in CRDS.items()}


def crd_for(doc: Doc) -> Doc:
    return CRDS[KIND_TO_PLURAL[doc["kind"]]]


def walk(schema: Schema, path: str = "") -> Iterator[tuple[str, Schema]]:
    """Every schema node with its path (.a.b for properties, [] for items, {} for map values)."""
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from walk(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}{{}}")


def to_json_schema(node: Schema) -> Schema:
    """Converts a structural OpenAPI v3 schema to JSON Schema, as strictly as the API server.

    Drops x-kubernetes-* keys, turns ``nullable`` into a null type, spells
    int-or-string as anyOf, and forbids unknown fields where the API server
    would prune them (kubectl's strict field validation rejects them).
    """
    out: Schema = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key == "properties":
            out[key] = {name: to_json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = to_json_schema(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [to_json_schema(sub) for sub in value]
        else:
            out[key] = copy.deepcopy(value)
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if (
        out.get("type") == "object"
        and "properties" in out
        and "additionalProperties" not in out
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


_FORMATS = jsonschema.FormatChecker(formats=())


def schema_errors(doc: Doc) -> list[str]:
    """Why the API server's schema validation would reject doc ([] when it accepts it)."""
    validator = jsonschema.Draft202012Validator(
        to_json_schema(schema_of(crd_for(doc))), format_checker=_FORMATS
    )
    return [
        f"{'.'.join(str(p) for p in err.absolute_path)}: {err.message}"
        for err in validator.iter_errors(doc)
    ]
