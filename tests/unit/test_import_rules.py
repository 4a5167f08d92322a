"""The import rules of docs/architecture.md hold, and would catch a forbidden import.

The rules are import-linter contracts in pyproject.toml (``[tool.importlinter]``), also
run by hack/verify. Every module of the three packages is named in docs/architecture.md.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"hermit_common": "common", "hermit_operator": "operator",
            "hermit_node": "node-agent", "hermit_testbed": "testbed"}
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _lint(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    if not LINT_IMPORTS.exists():
        pytest.fail(f"no {LINT_IMPORTS}: run hack/install-python (import-linter is a dev "
                    "dependency)")
    env = {**os.environ, "PYTHONPATH": str(pythonpath)} if pythonpath else None
    return subprocess.run([str(LINT_IMPORTS), "--config", str(REPO / "pyproject.toml")],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
                          check=False)


def test_the_project_keeps_every_import_rule() -> None:
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(("module", "injected", "contract"), [
    ("hermit_common/display.py", "import hermit_node.kube",
     "common is beneath the operator and the node-agent"),
    ("hermit_operator/placement.py", "import hermit_node.planner",
     "the operator and the node-agent do not import each other"),
    ("hermit_node/criu.py", "import hermit_node.metrics",
     "the node-agent's engine and host plumbing know neither Kubernetes nor metrics"),
])
def test_a_forbidden_import_breaks_its_rule(tmp_path: Path, module: str, injected: str,
                                            contract: str) -> None:
    """The same check on a copy of the packages with one forbidden import added."""
    for package, folder in PACKAGES.items():
        shutil.copytree(REPO / folder / package, tmp_path / package)
    with (tmp_path / module).open("a") as f:
        f.write(f"\n{injected}  # forbidden\n")
    result = _lint(tmp_path, pythonpath=tmp_path)
    assert result.returncode != 0, result.stdout[-3000:]
    broken = result.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, result.stdout[-3000:]


def test_every_module_is_named_in_the_architecture_page() -> None:
    page = (REPO / "docs/architecture.md").read_text()
    missing = []
    for package, folder in PACKAGES.items():
        if package == "hermit_testbed":
            continue
        for path in sorted((REPO / folder / package).rglob("*.py")):
            if path.name == "__init__.py":
                continue
            name = path.relative_to(REPO / folder / package).with_suffix("").as_posix()
            if f"{name}.py" not in page and f"`{name}`" not in page:
                missing.append(f"{package}/{name}.py")
    assert not missing, f"docs/architecture.md names no line for: {missing}"


# The runtime's own checkpoint/restore: the CRI RPC, the kubelet's checkpoint endpoint,
# containerd's restore-from-archive switches, crictl, and runc's checkpoint/restore verbs.
RUNTIME_CHECKPOINT_APIS = ("CheckpointContainer", "restore_via_create", "RestoreViaCreate",
                           "enable_criu", "crictl", "/checkpoint/", "org.criu.checkpoint",
                           '"checkpoint", "--', '"restore", "--bundle')


def test_hermit_never_uses_the_runtime_s_checkpoint_and_restore() -> None:
    """Hermit runs CRIU itself on the container's processes and restores into an ordinary
    container; containerd's CRI restore (off by default from 2.3.4 after CVEs, going in
    2.4) must stay out of it (docs/criu.md, containerd 2)."""
    found = []
    for top in ("common", "operator", "node-agent", "charts"):
        for path in sorted((REPO / top).rglob("*")):
            if not path.is_file() or path.suffix not in (".py", ".yaml", ".yml", ".tpl",
                                                         ".json", ".toml"):
                continue
            text = path.read_text(errors="replace")
            found += [f"{path.relative_to(REPO)}: {api}"
                      for api in RUNTIME_CHECKPOINT_APIS if api in text]
    assert found == []
