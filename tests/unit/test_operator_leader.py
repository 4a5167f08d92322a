"""Leader election on a Lease: the pure decision and the Lease written (no API)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from hermit_common.errors import SettingsError
from hermit_common.settings import OperatorSettings
from hermit_operator.leader import LEASE_SECONDS, decide, lease_body

NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)


def lease(holder: str | None, renewed: datetime | None, duration: int = LEASE_SECONDS) -> dict:
    spec: dict = {"leaseDurationSeconds": duration}
    if holder is not None:
        spec["holderIdentity"] = holder
    if renewed is not None:
        spec["renewTime"] = renewed.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {"metadata": {"name": "hermit-operator", "resourceVersion": "7"}, "spec": spec}


def test_no_lease_is_created() -> None:
    assert decide(None, "op-a", NOW).action == "create"


def test_the_holder_renews() -> None:
    assert decide(lease("op-a", NOW - timedelta(seconds=3)), "op-a", NOW).action == "renew"


def test_a_live_holder_makes_the_others_wait() -> None:
    d = decide(lease("op-a", NOW - timedelta(seconds=5)), "op-b", NOW)
    assert (d.action, d.holder) == ("wait", "op-a")


def test_an_expired_or_released_lease_is_taken() -> None:
    expired = lease("op-a", NOW - timedelta(seconds=LEASE_SECONDS + 1))
    assert decide(expired, "op-b", NOW).action == "take"
    assert decide(lease(None, NOW), "op-b", NOW).action == "take"
    assert decide(lease("op-a", None), "op-b", NOW).action == "take"
    # The lease's own duration counts, not ours.
    long = lease("op-a", NOW - timedelta(seconds=LEASE_SECONDS + 1), duration=60)
    assert decide(long, "op-b", NOW).action == "wait"


def test_lease_body_keeps_the_version_read_and_the_acquire_time() -> None:
    body = lease_body("hermit-operator", "op-b", NOW, transitions=3,
                      acquired="2026-12-01T11:00:00.000000Z", resource_version="7")
    assert body["metadata"] == {"name": "hermit-operator", "resourceVersion": "7"}
    assert body["spec"] == {"holderIdentity": "op-b", "leaseDurationSeconds": LEASE_SECONDS,
                            "acquireTime": "2026-12-01T11:00:00.000000Z",
                            "renewTime": "2026-12-01T12:00:00.000000Z",
                            "leaseTransitions": 3}
    fresh = lease_body("hermit-operator", "op-b", NOW, transitions=0, acquired=None,
                       resource_version=None)
    assert "resourceVersion" not in fresh["metadata"]
    assert fresh["spec"]["acquireTime"] == fresh["spec"]["renewTime"]


def test_leader_election_settings() -> None:
    s = OperatorSettings.from_env({"HERMIT_LEADER_ELECTION": "true",
                                   "HERMIT_NAMESPACE": "hermit", "HERMIT_POD_NAME": "op-1",
                                   "HERMIT_LEADER_ELECTION_LEASE": "my-lease"})
    assert (s.leader_election, s.namespace, s.identity, s.lease_name) == (
        True, "hermit", "op-1", "my-lease")
    assert OperatorSettings.from_env({}).leader_election is False
    with pytest.raises(SettingsError, match="HERMIT_NAMESPACE"):
        OperatorSettings.from_env({"HERMIT_LEADER_ELECTION": "true"})
