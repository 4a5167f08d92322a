"""The Helm chart for the tests: its path, values and schema, a helm binary when there
is one, and the merged values and schema errors of a set of overrides."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

CHART = ROOT / "charts" / "hermit"

Values = dict[str, Any]

VALUES: Values = yaml.safe_load((CHART / "values.yaml").read_text())

SCHEMA: dict[str, Any] = yaml.safe_load((CHART / "values.schema.json").read_text())

WITH_BUCKET: Values = {**copy.deepcopy(VALUES), "s3": {**VALUES["s3"], "bucket": "checkpoints"}}


def merged(base: Values, override: Values) -> Values:
    """Helm's merge of user values over the chart's: maps merge, everything else replaces."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def errors(values: Values) -> list[str]:
    validator = jsonschema.Draft7Validator(SCHEMA)
    return [
        f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
        for e in validator.iter_errors(values)
    ]


def find_helm() -> str | None:
    cached = Path(os.environ.get("HERMIT_CACHE", Path.home() / ".cache" / "hermit")) / "bin"
    return shutil.which("helm") or shutil.which("helm", path=str(cached))


def render(*sets: str) -> list[dict[str, Any]]:
    """The chart's documents as `helm template` renders them with a bucket and a store role
    (and ``sets``, each a ``--set`` argument); fails saying how to get helm without one."""
    helm = find_helm()
    if helm is None:
        pytest.fail("no helm binary on PATH or in ~/.cache/hermit/bin: run hack/install-helm")
    args = [helm, "template", "hermit", str(CHART), "--namespace", "hermit-system",
            "--set", "s3.bucket=checkpoints", "--set",
            "s3.scopedCredentials.roleArn=arn:aws:iam::123456789012:role/hermit-store"]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, check=True, capture_output=True, text=True, timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]
