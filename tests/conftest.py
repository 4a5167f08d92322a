"""Shared pytest configuration: fixtures for the real components live in tests/support/."""

pytest_plugins = [
    "tests.support.minio",
    "tests.support.aemm",
    "tests.support.containerd",
    "tests.support.criu",
    "tests.support.attacks",
]
