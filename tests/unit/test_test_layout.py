"""The tests' own house rules (issue 18, one support library): a test module imports no
other test module (what two modules share lives in tests/support/ or the e2e helpers),
no test module defines its own wait loop (tests/support/wait.py has the one
``wait_until``), and no e2e or fault test runs ``hack/cluster`` itself (cluster actions
go through tests/e2e/sandboxes.py, whose commands E2EConfig makes configurable for
other clusters)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
TEST_MODULES = sorted(TESTS.rglob("test_*.py"))
CLUSTER_TIERS = ("e2e", "faults")
WAIT_NAMES = {"wait_until", "_wait", "wait", "_wait_until", "_poll"}


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(TESTS)) for p in paths]


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _imported_modules(tree: ast.Module) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def _commands_naming_hack_cluster(tree: ast.Module) -> list[int]:
    """Lines of subprocess calls whose arguments name hack/cluster (a message that tells
    the reader to run it is fine)."""
    lines = set()
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) \
                and isinstance(call.func.value, ast.Name) and call.func.value.id == "subprocess":
            for node in ast.walk(call):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                        and "hack/cluster" in node.value:
                    lines.add(call.lineno)
    return sorted(lines)


def test_the_rules_see_every_test_module() -> None:
    assert len(TEST_MODULES) > 100, _ids(TEST_MODULES)


@pytest.mark.parametrize("path", TEST_MODULES, ids=_ids(TEST_MODULES))
def test_no_test_module_imports_another(path: Path) -> None:
    borrowed = sorted({m for m in _imported_modules(_tree(path))
                       if any(part.startswith("test_") for part in m.split("."))})
    assert not borrowed, (f"{path.relative_to(TESTS)} imports {borrowed}: move what both "
                          "use to tests/support/")


@pytest.mark.parametrize("path", TEST_MODULES, ids=_ids(TEST_MODULES))
def test_no_test_module_has_its_own_wait_loop(path: Path) -> None:
    own = sorted(node.name for node in ast.walk(_tree(path))
                 if isinstance(node, ast.FunctionDef) and node.name in WAIT_NAMES)
    assert not own, (f"{path.relative_to(TESTS)} defines {own}: use "
                     "tests.support.wait.wait_until")


CLUSTER_MODULES = [p for p in TEST_MODULES if p.relative_to(TESTS).parts[0] in CLUSTER_TIERS]


@pytest.mark.parametrize("path", CLUSTER_MODULES, ids=_ids(CLUSTER_MODULES))
def test_no_cluster_test_runs_hack_cluster_itself(path: Path) -> None:
    direct = _commands_naming_hack_cluster(_tree(path))
    assert not direct, (f"{path.relative_to(TESTS)} runs hack/cluster on lines {direct}: "
                        "run cluster actions through tests/e2e/sandboxes.py (E2EConfig)")


def test_the_rules_catch_what_they_forbid(tmp_path: Path) -> None:
    """Each rule fails on a module that breaks it."""
    bad = tmp_path / "test_bad.py"
    bad.write_text('"""Run hack/cluster up first."""\n'
                   "import subprocess\n"
                   "from tests.e2e.test_moves import helper\n"
                   "def _wait(x):\n    pass\n"
                   "print('hack/cluster load-images, then')\n"
                   "subprocess.run([str(REPO / 'hack/cluster'), 'up'])\n")
    tree = _tree(bad)
    assert "tests.e2e.test_moves" in set(_imported_modules(tree))
    assert [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)] == ["_wait"]
    assert _commands_naming_hack_cluster(tree) == [7]
