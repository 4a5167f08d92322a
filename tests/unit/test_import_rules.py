"""The import rules of docs/architecture.md hold, and would catch a forbidden import.

The rules are import-linter contracts in pyproject.toml (``[tool.importlinter]``), also
run by hack/verify: each package's layers, and the forbidden and independence rules
beside them. Each rule is shown breaking on a copy of the packages with one forbidden
import added. That every module is named in docs/architecture.md, under the layer its
contract gives it, is tests/unit/test_architecture_doc.py.
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

COMMON_BENEATH = "common is beneath the operator and the node-agent"
INDEPENDENT = "the operator and the node-agent do not import each other"
ENGINE_NO_KUBE = "the node-agent's engine and host plumbing know neither Kubernetes nor metrics"
NODE_LAYERS = "the node-agent's layers: main, turns, control, engine, host"
CONTROL_LAYERS = "the node-agent's control: the loop above what it drives"
HOST_NO_STORE = "the node-agent's host plumbing knows neither the store nor the manifest"
WORKER = "the restore worker imports neither the store nor Kubernetes"
WATCHERS = "the cloud watchers import nothing else of the node-agent"
OPERATOR_PURE = "the operator's decisions are pure: no kopf, no Kubernetes client, no metrics"
OPERATOR_LAYERS = "the operator's layers: entry points, servers, driver, adapters, decisions"
COMMON_LAYERS = "hermit_common's layers: clients, formats and rules, vocabulary"
TWO_SIDES = "the checkpoint side and the restore side share only the manifest format"
STORE_LAYERS = "the store's layers: uploads and downloads, data keys, chunks, objects"


def _lint(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    if not LINT_IMPORTS.exists():
        pytest.fail(f"no {LINT_IMPORTS}: run hack/install-python (import-linter is a dev "
                    "dependency)")
    env = {**os.environ, "PYTHONPATH": str(pythonpath)} if pythonpath else None
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", str(REPO / "pyproject.toml")],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
                          check=False)


def _broken(stdout: str) -> dict[str, str]:
    """The report of each broken contract, by the contract's name."""
    _, _, tail = stdout.partition("Broken contracts")
    lines = tail.splitlines()
    sections: dict[str, list[str]] = {}
    current: list[str] = []
    for i, line in enumerate(lines):
        underline = lines[i + 1] if i + 1 < len(lines) else ""
        if line and underline and set(underline) == {"-"} and len(underline) == len(line):
            current = sections.setdefault(line, [])
        else:
            current.append(line)
    return {name: "\n".join(text) for name, text in sections.items()}


def _copy_packages(dest: Path) -> None:
    for package, folder in PACKAGES.items():
        shutil.copytree(REPO / folder / package, dest / package,
                        ignore=shutil.ignore_patterns("__pycache__"))


def test_the_project_keeps_every_import_rule() -> None:
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout
    for contract in (NODE_LAYERS, CONTROL_LAYERS, OPERATOR_LAYERS, COMMON_LAYERS, TWO_SIDES,
                     WATCHERS, STORE_LAYERS):
        assert f"{contract} KEPT" in result.stdout, result.stdout[-3000:]


@pytest.mark.parametrize(("module", "injected", "contract", "reported"), [
    ("hermit_common/display.py", "import hermit_node.control.kube", COMMON_BENEATH,
     "hermit_common.display -> hermit_node.control.kube"),
    ("hermit_operator/placement.py", "import hermit_node.control.planner", INDEPENDENT,
     "hermit_operator.placement -> hermit_node.control.planner"),
    ("hermit_node/host/criu.py", "import hermit_node.control.metrics", ENGINE_NO_KUBE,
     "hermit_node.host.criu -> hermit_node.control.metrics"),
    # host imports control: the layers, from below
    ("hermit_node/host/freezer.py", "import hermit_node.control.agent", NODE_LAYERS,
     "hermit_node.host.freezer -> hermit_node.control.agent"),
    # engine imports the Kubernetes adapter
    ("hermit_node/engine/checkpoint.py", "from hermit_node.control.kube import Kube", NODE_LAYERS,
     "hermit_node.engine.checkpoint -> hermit_node.control.kube"),
    # host imports the engine
    ("hermit_node/host/locate.py", "from hermit_node.engine import staging", NODE_LAYERS,
     "hermit_node.host.locate -> hermit_node.engine.staging"),
    ("hermit_node/host/pagemap.py", "import hermit_common.manifest", HOST_NO_STORE,
     "hermit_node.host.pagemap -> hermit_common.manifest"),
    ("hermit_node/engine/restore_worker.py", "import hermit_common.store", WORKER,
     "hermit_node.engine.restore_worker -> hermit_common.store"),
    ("hermit_node/control/watchers/aws.py", "from hermit_node.control import planner",
     WATCHERS,
     "hermit_node.control.watchers.aws -> hermit_node.control.planner"),
    ("hermit_node/engine/checkpoint.py", "import hermit_node.engine.restore", TWO_SIDES,
     "hermit_node.engine.checkpoint -> hermit_node.engine.restore"),
    # control's adapters import the loop above them
    ("hermit_node/control/kube.py", "from hermit_node.control import agent", CONTROL_LAYERS,
     "hermit_node.control.kube -> hermit_node.control.agent"),
    # the wiring, from below: control imports start-up
    ("hermit_node/control/agent.py", "from hermit_node import main", NODE_LAYERS,
     "hermit_node.control.agent -> hermit_node.main"),
    ("hermit_operator/reconcile.py", "from hermit_operator.kube import Kube", OPERATOR_PURE,
     "hermit_operator.reconcile -> hermit_operator.kube"),
    ("hermit_operator/podspec.py", "from hermit_operator import driver", OPERATOR_LAYERS,
     "hermit_operator.podspec -> hermit_operator.driver"),
    ("hermit_common/errors.py", "import hermit_common.store", COMMON_LAYERS,
     "hermit_common.errors -> hermit_common.store"),
    # the store's S3 objects import the upload above them
    ("hermit_common/store/objects.py", "from hermit_common.store import upload", STORE_LAYERS,
     "hermit_common.store.objects -> hermit_common.store.upload"),
])
def test_a_forbidden_import_breaks_its_rule(tmp_path: Path, module: str, injected: str,
                                            contract: str, reported: str) -> None:
    """The same check on a copy of the packages with one forbidden import added: the
    contract breaks, and its report names the import (``a -> b (l.N)``)."""
    _copy_packages(tmp_path)
    with (tmp_path / module).open("a") as f:
        f.write(f"\n{injected}  # forbidden\n")
    result = _lint(tmp_path, pythonpath=tmp_path)
    assert result.returncode != 0, result.stdout[-3000:]
    broken = _broken(result.stdout)
    assert contract in broken, result.stdout[-3000:]
    assert reported in broken[contract], broken[contract]


def test_a_module_without_a_layer_breaks_the_layers(tmp_path: Path) -> None:
    """`exhaustive`: a new node-agent module must be given its layer."""
    _copy_packages(tmp_path)
    (tmp_path / "hermit_node" / "newmodule.py").write_text('"""A module with no layer."""\n')
    result = _lint(tmp_path, pythonpath=tmp_path)
    assert result.returncode != 0, result.stdout[-3000:]
    broken = _broken(result.stdout)
    assert NODE_LAYERS in broken, result.stdout[-3000:]
    assert "not listed as layers" in broken[NODE_LAYERS], broken[NODE_LAYERS]
    assert "hermit_node.newmodule" in broken[NODE_LAYERS], broken[NODE_LAYERS]


def test_a_known_violation_once_removed_must_leave_the_list(tmp_path: Path) -> None:
    """ignore_imports lists known violations exactly: one that no longer happens fails,
    so the list only shrinks (seal.sealing_from's import of keyclient, removed here)."""
    _copy_packages(tmp_path)
    seal = tmp_path / "hermit_common" / "seal.py"
    text = seal.read_text()
    line = "        from hermit_common.keyclient import RemoteKeyWrapper\n"
    assert text.count(line) == 1, "the known violation moved: update this test"
    seal.write_text(text.replace(line, "        RemoteKeyWrapper = None\n"))
    result = _lint(tmp_path, pythonpath=tmp_path)
    assert result.returncode != 0, result.stdout[-3000:]
    assert "hermit_common.seal -> hermit_common.keyclient" in result.stdout + result.stderr


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
