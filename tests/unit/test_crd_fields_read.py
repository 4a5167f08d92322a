"""Every spec field in crds/ is read by the code: a field in the CRD is a promise.

The same check as ``../shared/tools/crd-fields-unread``: a field counts as read when
its camelCase name appears as a quoted string (``"name"`` or ``'name'``) in the Python
sources of operator/, node-agent/ or common/ (tests excluded). Every property under
``spec`` is walked, into objects and array items, except inside the embedded
Kubernetes types (``podTemplate``, ``tolerations``, ``nodeSelector``, ``metadata``),
whose internals are the pod's business. A field that fails here is either read by
new code (with a test) or removed from the schema, the samples and the docs until it
is.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_DIR = ROOT / "crds"
SOURCE_DIRS = ("operator", "node-agent", "common")
SKIP_INSIDE = {"podTemplate", "tolerations", "nodeSelector", "metadata"}

Schema = dict[str, Any]


def _is_test(path: Path) -> bool:
    return (path.name.startswith("test_") or path.name == "conftest.py"
            or "tests" in path.parts)


def code_sources() -> str:
    """The Python sources that count as readers (tests excluded)."""
    return "\n".join(
        path.read_text(errors="ignore")
        for directory in SOURCE_DIRS
        for path in sorted((ROOT / directory).rglob("*.py"))
        if not _is_test(path.relative_to(ROOT))
    )


def spec_fields(schema: Schema, path: str = "spec") -> Iterator[tuple[str, str]]:
    """(name, path) of every property below schema, as the tool walks them."""
    for name, sub in (schema.get("properties") or {}).items():
        yield name, f"{path}.{name}"
        if name not in SKIP_INSIDE:
            yield from spec_fields(sub, f"{path}.{name}")
            if isinstance(sub.get("items"), dict):
                yield from spec_fields(sub["items"], f"{path}.{name}[]")


def is_read(name: str, source: str) -> bool:
    return re.search(f"[\"']{re.escape(name)}[\"']", source) is not None


def unread_fields(source: str) -> list[str]:
    unread: list[str] = []
    for crd_path in sorted(CRD_DIR.glob("*.yaml")):
        doc = yaml.safe_load(crd_path.read_text())
        if not doc or doc.get("kind") != "CustomResourceDefinition":
            continue
        kind = doc["spec"]["names"]["kind"]
        for version in doc["spec"]["versions"]:
            root = version["schema"]["openAPIV3Schema"]
            spec = (root.get("properties") or {}).get("spec") or {}
            unread += [f"{kind}.{path}" for name, path in spec_fields(spec)
                       if not is_read(name, source)]
    return unread


def test_every_crd_spec_field_is_read_by_the_code() -> None:
    unread = unread_fields(code_sources())
    assert unread == [], (
        "CRD spec fields that no code under operator/, node-agent/ or common/ reads "
        f"(implement them with a test, or remove them from crds/ and the samples): {unread}"
    )


def test_the_walk_covers_nested_objects_and_array_items_but_not_embedded_types() -> None:
    schema: Schema = {"properties": {
        "podTemplate": {"properties": {"spec": {"properties": {"containers": {}}}}},
        "placement": {"properties": {
            "tolerations": {"items": {"properties": {"effect": {}}}},
            "nodeSelector": {"properties": {"zone": {}}},
        }},
        "hooks": {"type": "array", "items": {"properties": {"onTurn": {}}}},
        "store": {"properties": {"secretRef": {"properties": {"name": {}}}}},
    }}
    assert [path for _, path in spec_fields(schema)] == [
        "spec.podTemplate",
        "spec.placement", "spec.placement.tolerations", "spec.placement.nodeSelector",
        "spec.hooks", "spec.hooks[].onTurn",
        "spec.store", "spec.store.secretRef", "spec.store.secretRef.name",
    ]


def test_a_field_is_read_only_when_its_name_is_a_quoted_string() -> None:
    source = 'spec.get("retain")\nx = checkpoint[\'onPreemption\']\n# intervalSeconds\n'
    assert is_read("retain", source)
    assert is_read("onPreemption", source)
    assert not is_read("intervalSeconds", source)  # a comment, not a quoted string
    assert not is_read("onTurn", source)
    assert not is_read("retai", source)


def test_the_known_readers_are_found() -> None:
    source = code_sources()
    # Fields the operator and node-agent are known to act on.
    for name in ("podTemplate", "restoreFrom", "intervalSeconds", "sandboxRef", "reason"):
        assert is_read(name, source), name
    assert not _is_test(Path("operator/hermit_operator/reconcile.py"))
    assert _is_test(Path("operator/tests/test_x.py"))
