"""docs/architecture.md stays true and traceable.

- Every module of hermit_common, hermit_operator and hermit_node (watchers included) has
  a line in the page's layer tables ("Code layout"), under the layer its package's
  import-linter `layers` contract (pyproject.toml) gives it.
- Every function the move table ("A move, step by step, in the code") names exists: each
  ``hermit_*`` dotted name is imported and looked up attribute by attribute, each
  ``hermit-init.c:name`` is a function defined in node-agent/init/hermit-init.c; and the
  table takes the steps of a move in order.
"""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "architecture.md"
PACKAGES = {"hermit_common": "common", "hermit_operator": "operator", "hermit_node": "node-agent"}
LAYER_SECTIONS = {"hermit_common": "### hermit_common's layers",
                  "hermit_operator": "### The operator's layers",
                  "hermit_node": "### The node-agent's layers"}
MOVE_SECTION = "### A move, step by step, in the code"
MOVE_STEPS = ["notice", "taint", "request", "claim", "freeze", "dump", "upload", "durable",
              "operator", "new pod", "admit", "restore", "adopted", "running"]
INIT_SOURCE = REPO / "node-agent" / "init" / "hermit-init.c"


def _section(heading: str) -> str:
    """The page's text from ``heading`` to the next heading of the same or a higher level."""
    text = PAGE.read_text()
    assert heading in text, f"docs/architecture.md has no section {heading!r}"
    body = text.split(heading, 1)[1]
    level = heading.split(" ", 1)[0]
    stop = re.search(rf"^#{{1,{len(level)}}} ", body, re.MULTILINE)
    return body[: stop.start()] if stop else body


def _rows(section: str) -> list[list[str]]:
    """The cells of each table row of ``section`` (header and rule rows left out)."""
    rows = []
    for line in section.splitlines():
        if not line.startswith("|") or set(line) <= {"|", "-", " "}:
            continue
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows[1:] if rows else rows  # the header row


def _modules(package: str) -> list[Path]:
    """The package's module files, relative to the repository; an empty __init__.py (a
    bare package marker) is not a module with something to say."""
    root = REPO / PACKAGES[package] / package
    return sorted(p.relative_to(REPO) for p in root.rglob("*.py")
                  if p.name != "__init__.py" or p.read_text().strip())


def _contract_layers(package: str) -> list[set[str]]:
    """The layers of the package's `layers` contract in pyproject.toml, top first: the
    names of the package's children in each."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    contracts: list[dict[str, Any]] = config["tool"]["importlinter"]["contracts"]
    found = [c for c in contracts if c["type"] == "layers" and c.get("containers") == [package]]
    assert len(found) == 1, f"pyproject.toml: no single layers contract for {package}"
    return [{name.strip() for name in re.split(r"[:|]", layer)} for layer in found[0]["layers"]]


def _layer_table(package: str) -> dict[str, int]:
    """Module path -> the index of the layer its row is under (a row with an empty layer
    cell continues the layer above it), from the package's table on the page."""
    layers: list[str] = []
    placed: dict[str, int] = {}
    for row in _rows(_section(LAYER_SECTIONS[package])):
        layer, module = row[0], row[1].strip("`")
        if layer:
            assert layer not in layers, f"{package}: layer {layer!r} appears twice"
            layers.append(layer)
        assert layers, f"{package}: the first row of the table names no layer"
        placed[module] = len(layers) - 1
    return placed


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_every_module_has_a_line_under_its_layer(package: str) -> None:
    contract = _contract_layers(package)
    placed = _layer_table(package)
    root = Path(PACKAGES[package]) / package
    missing, misplaced = [], []
    for path in _modules(package):
        child = path.relative_to(root).parts[0].removesuffix(".py")
        want = next(i for i, names in enumerate(contract) if child in names)
        if str(path) not in placed:
            missing.append(str(path))
        elif placed[str(path)] != want:
            misplaced.append(f"{path}: under layer {placed[str(path)] + 1}, its contract "
                             f"says {want + 1}")
    assert not missing, f"docs/architecture.md has no line for: {missing}"
    assert not misplaced, misplaced
    stale = sorted(set(placed) - {str(p) for p in _modules(package)})
    assert not stale, f"docs/architecture.md lists modules that do not exist: {stale}"


def test_the_move_table_takes_every_step_in_order() -> None:
    steps = [row[1] for row in _rows(_section(MOVE_SECTION))]
    assert steps == MOVE_STEPS
    for row in _rows(_section(MOVE_SECTION)):
        assert re.search(r"`hermit[_-]", row[-1]), f"step {row[1]!r} names no code"


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            target = getattr(target, name)
        return target
    raise ModuleNotFoundError(dotted)


def test_every_function_the_move_table_names_exists() -> None:
    section = _section(MOVE_SECTION)
    names = re.findall(r"`(hermit_[a-z]+(?:\.\w+)+)`", section)
    assert len(names) >= len(MOVE_STEPS)
    missing = []
    for dotted in names:
        try:
            _resolve(dotted)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{dotted}: {exc}")
    init = INIT_SOURCE.read_text()
    for name in re.findall(r"`hermit-init\.c:(\w+)`", section):
        if not re.search(rf"^static [\w ]+\b{name}\(", init, re.MULTILINE):
            missing.append(f"hermit-init.c:{name}: no such function")
    assert not missing, missing
