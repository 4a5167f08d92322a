"""hack/ci-shards names every test file of the cluster session once (hack/test ci runs
the session as two shards, each on its own hack/cluster instance): a new file is not left
out of CI, and every attack test runs in one shard (one attack table)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _shards() -> list[tuple[int, str]]:
    rows = []
    for line in (REPO / "hack/ci-shards").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            shard, path = line.split()
            rows.append((int(shard), path))
    return rows


def _cluster_session() -> set[str]:
    """The files hack/test ci's cluster session runs: the e2e tier, the fault suite and
    the integration tier's attack tests."""
    files = {str(p.relative_to(REPO)) for tier in ("e2e", "faults")
             for p in (REPO / "tests" / tier).glob("test_*.py")}
    files |= {str(p.relative_to(REPO)) for p in (REPO / "tests/integration").glob("test_*.py")
              if re.search(r"pytest\.mark\.attack\b", p.read_text())}
    return files


def test_every_file_of_the_cluster_session_is_in_one_shard() -> None:
    rows = _shards()
    paths = [path for _, path in rows]
    assert len(paths) == len(set(paths)), "a file listed twice"
    assert {shard for shard, _ in rows} == {0, 1}
    assert set(paths) == _cluster_session(), (set(paths) ^ _cluster_session())


def test_the_attack_tests_and_the_fault_suite_each_run_in_one_shard() -> None:
    rows = _shards()
    attack = {shard for shard, path in rows
              if re.search(r"pytest\.mark\.attack\b", (REPO / path).read_text())}
    faults = {shard for shard, path in rows if path.startswith("tests/faults/")}
    assert len(attack) == 1 and len(faults) == 1, (attack, faults)
