"""The restore asks the store to verify a sealed manifest for the sandbox uid it restores,
first: a refusal there comes before the compatibility checks, the policy and any write."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hermit_common.errors import CheckpointRefused
from hermit_common.pin import Pin
from hermit_node.engine.restore import RestoreEngine, RestoreTarget


class _RefusingStore:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def read_manifest(self, pin: Pin) -> Any:
        self.calls.append(("read_manifest", pin.namespace, pin.sandbox, pin.checkpoint,
                           pin.uid, pin.parent, pin.lineage))
        raise CheckpointRefused(f"checkpoint {pin.namespace}/{pin.checkpoint} is refused: its "
                                "manifest's signature (sealing key '1') does not verify")

    def download(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(("download",))
        raise AssertionError("downloaded a refused checkpoint")


class _NoCriu:
    def version(self) -> str:
        raise AssertionError("CRIU consulted for a refused checkpoint")


def test_a_manifest_that_does_not_verify_stops_the_restore_first(tmp_path: Path) -> None:
    store = _RefusingStore()
    engine = RestoreEngine(_NoCriu(), store, tmp_path)  # type: ignore[arg-type]
    target = RestoreTarget(pin=Pin("team-a", "box", "c1", uid="uid-1", parent="c0",
                                   lineage=("uid-0", "uid-1")), init_pid=1)
    local = tmp_path / "staging"
    local.mkdir()
    with pytest.raises(CheckpointRefused, match=r"team-a/c1 is refused: .*sealing key '1'"):
        engine._download(target, None, local)  # type: ignore[arg-type]
    assert store.calls == [("read_manifest", "team-a", "box", "c1", "uid-1", "c0",
                            ("uid-0", "uid-1"))]
    assert list(local.iterdir()) == []
