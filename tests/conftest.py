"""Shared pytest configuration: fixtures for the real components live in tests/support/,
the cluster's (e2e and fault tiers) in tests/e2e/cluster.py. Each test gets the marker of
its tier from its folder, so one run can select across tiers (hack/test ci)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = [
    "tests.support.minio",
    "tests.support.aemm",
    "tests.support.containerd",
    "tests.support.criu",
    "tests.support.attacks",
    "tests.e2e.cluster",
]

TIERS = ("integration", "e2e", "faults")
_HERE = Path(__file__).resolve().parent


def tier_of(path: Path) -> str | None:
    """The tier a test file belongs to by its folder under tests/ (unit: none)."""
    try:
        top = path.resolve().relative_to(_HERE).parts[0]
    except (ValueError, IndexError):
        return None
    return top if top in TIERS else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(item.path)
        if tier is not None:
            item.add_marker(tier)
